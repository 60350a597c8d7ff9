"""The import paths of modules that moved when each op became a package, kept working
until :data:`REMOVED_IN`, with a ``DeprecationWarning``.

``import maskconv_kernels.pallas`` (or ``from maskconv_kernels.spec import make_spec``)
finds the module at its new path, by a finder installed when the package is imported:
one table here instead of a shim file per old module. The old path names the same
module object, so its functions and classes are the new ones. The other old names (each
backend's config class before it was ``Config``, ``implementation="pallas"``) warn
through :func:`warn` too, so that every message names the same release.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

__all__ = ["MOVED", "REMOVED_IN", "install", "module_attribute", "renamed_attributes", "warn"]

_PACKAGE = __name__.rpartition(".")[0]

# The release that drops every old name this module keeps working: the minor release
# after the one that moved them (0.1.0).
REMOVED_IN = "0.2.0"

# old module (below the package) -> new module
MOVED = {
    "api": "ops.masked_conv.api",
    "backends": "ops.masked_conv.backends",
    "core": "ops.masked_conv.maps",
    "spec": "ops.masked_conv.spec",
    "problem": "ops.masked_conv.kernel_problem",
    "layout": "ops.masked_conv.layout",
    "reference": "ops.masked_conv.reference",
    "decode": "ops.masked_conv.decode",
    "xla": "ops.masked_conv.xla",
    "xla_blocks": "ops.masked_conv.xla.blocks",
    "depthwise": "ops.masked_conv.xla.depthwise",
    "pallas": "ops.masked_conv.pallas_triton",
    "triton": "ops.masked_conv.triton",
    "mosaic_gpu": "ops.masked_conv.pallas_mosaic_gpu",
    "short_conv": "ops.causal_conv1d",
    "short_conv_kernels": "ops.causal_conv1d.pallas_triton",
    "spatial": "parallel",
    "sharding": "_core.partitioning",
    "hardware": "_core.hardware",
    "audit.audit": "audit",
}


def _target(fullname: str) -> str | None:
    """The new name of ``fullname`` when it is, or lies below, a moved module."""
    prefix = _PACKAGE + "."
    if not fullname.startswith(prefix):
        return None
    rest = fullname[len(prefix):]
    for old, new in MOVED.items():
        if rest == old or rest.startswith(old + "."):
            return f"{prefix}{new}{rest[len(old):]}"
    return None


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        new = _target(fullname)
        if new is None:
            return None
        # importlib's own frames are skipped: the warning points at the import statement.
        warn(fullname, new, stacklevel=2)
        module = importlib.import_module(new)
        is_package = hasattr(module, "__path__")
        return importlib.machinery.ModuleSpec(fullname, self, is_package=is_package)

    def create_module(self, spec):
        module = importlib.import_module(_target(spec.name))
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module):
        # Already executed under its new name; importlib has just set its __spec__ to the
        # old path's: give it back its own, so reload() and introspection see the new one.
        module.__spec__ = self._own_spec


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())


def warn(old: str, new: str, stacklevel: int = 1) -> None:
    """The ``DeprecationWarning`` of every old name: ``old`` goes in :data:`REMOVED_IN`, ``new``
    replaces it. ``stacklevel`` counts from the caller, as :func:`warnings.warn`'s does."""
    warnings.warn(
        f"{old} is deprecated and will be removed in maskconv-kernels {REMOVED_IN}: use {new}",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


def module_attribute(name: str):
    """``maskconv_kernels.<name>`` for a moved module read as an attribute (``mk.api``,
    ``mk.spatial``, ``from maskconv_kernels import spatial``), with its warning."""
    if name not in MOVED:
        raise AttributeError(f"module {_PACKAGE!r} has no attribute {name!r}")
    new = f"{_PACKAGE}.{MOVED[name]}"
    warn(f"{_PACKAGE}.{name}", new, stacklevel=2)
    # By its new path: the old one would warn a second time, from the finder.
    return importlib.import_module(new)


def renamed_attributes(module: str, renamed: dict[str, str]):
    """A module ``__getattr__`` for the names ``module`` renamed (``{old: new}``): reading an
    old one warns and gives the object of the new one, so the old name is no plain alias
    that code could keep using unwarned."""

    def __getattr__(name: str):
        if name not in renamed:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warn(f"{module}.{name}", f"{module}.{renamed[name]}", stacklevel=2)
        return getattr(sys.modules[module], renamed[name])

    return __getattr__
