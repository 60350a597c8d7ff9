"""The package's import graph has no circle (lazy imports inside functions included), and the
shim that keeps the old module paths and names working warns on each, and only there."""
from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import maskconv_kernels
from maskconv_kernels._moved import MOVED, REMOVED_IN

ROOT = Path(maskconv_kernels.__file__).parent
PACKAGE = "maskconv_kernels"
# Imported when the Mosaic GPU kernels run, and only then.
MOSAIC_KERNELS = f"{PACKAGE}.ops.masked_conv.pallas_mosaic_gpu.kernels"


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _import_nodes(name: str, path: Path):
    """``(absolute module, names)`` of each import statement in ``name``'s code: ``names``
    empty for ``import module``, the imported names for ``from module import names``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((a.name, ()) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            yield base, tuple(a.name for a in node.names)


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports, anywhere in its code."""
    out = set()
    for base, names in _import_nodes(name, path):
        # "from pkg import sub" imports the submodule when there is one.
        targets = [f"{base}.{n}" if f"{base}.{n}" in modules else base for n in names] or [base]
        out |= {t for t in targets if t in modules and t != name}
    return out


def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    done, stack = set(), []

    def visit(name):
        if name in stack:
            raise AssertionError("import circle: " + " -> ".join(stack[stack.index(name):] + [name]))
        if name in done:
            return
        stack.append(name)
        for target in sorted(graph[name]):
            visit(target)
        stack.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_api_and_sharding_do_not_import_each_other():
    modules = _modules()
    api, partitioning = f"{PACKAGE}.ops.masked_conv.api", f"{PACKAGE}._core.partitioning"
    assert partitioning not in _imports(api, modules[api], modules)
    assert api not in _imports(partitioning, modules[partitioning], modules)


def test_choosing_a_backend_on_cpu_imports_no_mosaic_gpu_module():
    """implementation=None on CPU asks every GPU backend whether it runs; the Mosaic GPU
    backend answers without importing its kernels or jax's Mosaic GPU (jax 0.10's needs
    absl-py, which a plain install lacks), and the Triton one without triton."""
    code = (
        "import sys, numpy as np, jax.numpy as jnp, maskconv_kernels as mk\n"
        "for dtype in (np.float32, jnp.bfloat16):\n"
        "    mk.masked_conv(np.ones((1, 5, 5, 2), dtype), np.ones((3, 3, 2, 2), dtype), np.ones((3, 3)))\n"
        f"prefixes = ('jax.experimental.mosaic', {MOSAIC_KERNELS!r}, 'triton', 'jax_triton')\n"
        "print(sorted(m for m in sys.modules if m.startswith(prefixes)))\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "[]", out.stdout
    assert MOSAIC_KERNELS in _modules()  # a prefix that names no module could never fail


def _deprecated(old: str, new: str) -> str:
    """The shim's warning for ``old``, as a pattern: the new name and the release that removes the old."""
    return re.escape(f"{old} is deprecated and will be removed in maskconv-kernels {REMOVED_IN}: use {new}")


def test_the_removal_release_is_the_next_minor_one_and_the_docs_name_it():
    major, minor = maskconv_kernels.__version__.split(".")[:2]
    assert REMOVED_IN == f"{major}.{int(minor) + 1}.0"
    assert f"removed in {REMOVED_IN}" in (ROOT.parent / "docs" / "backends.md").read_text()


def test_old_module_paths_name_the_moved_modules_and_warn(monkeypatch):
    # Every module path of the flat layout still imports, as a module and as an attribute,
    # and is the moved module itself (one object: its functions are the new ones).
    import maskconv_kernels as mk

    for old, new in MOVED.items():
        old_path, new_path = f"{PACKAGE}.{old}", f"{PACKAGE}.{new}"
        monkeypatch.delitem(sys.modules, old_path, raising=False)  # the finder runs only for a first import
        with pytest.warns(DeprecationWarning, match=_deprecated(old_path, new_path)):
            module = importlib.import_module(old_path)
        assert module is importlib.import_module(new_path), old
        if "." not in old:
            monkeypatch.delattr(mk, old, raising=False)  # set by the import: read it through __getattr__
            with pytest.warns(DeprecationWarning, match=_deprecated(old_path, new_path)):
                assert getattr(mk, old) is module, old
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        mk.nothing  # noqa: B018


def test_the_warnings_point_at_the_code_that_used_the_old_name(monkeypatch):
    """A ``DeprecationWarning`` shows by default only where ``__main__`` triggers it: the shim's
    are attributed to the import statement or attribute read, not to the package."""
    import maskconv_kernels as mk

    monkeypatch.delitem(sys.modules, f"{PACKAGE}.hardware", raising=False)
    for old in ("hardware", "spatial"):  # attributes once imported: read through __getattr__ here
        if old in vars(mk):  # not hasattr: that reads it through __getattr__, which has no attribute to delete
            monkeypatch.delattr(mk, old)
    with pytest.warns(DeprecationWarning) as imported:
        import maskconv_kernels.hardware  # noqa: F401
    with pytest.warns(DeprecationWarning) as read:
        mk.spatial  # noqa: B018
    with pytest.warns(DeprecationWarning) as renamed:
        mk.ops.masked_conv.xla.XlaConfig  # noqa: B018
    assert {w.filename for w in [*imported, *read, *renamed]} == {__file__}


CONFIGS = {  # module: its config's name before every backend's config was Config
    "ops.masked_conv.xla": "XlaConfig",
    "ops.masked_conv.xla.conv": "XlaConfig",
    "ops.masked_conv.pallas_triton": "BlockSizes",
    "ops.masked_conv.pallas_triton.config": "BlockSizes",
    "ops.masked_conv.triton": "Configs",
    "ops.masked_conv.triton.config": "Configs",
    "ops.masked_conv.pallas_mosaic_gpu": "Tiles",
    "ops.masked_conv.pallas_mosaic_gpu.config": "Tiles",
    "ops.causal_conv1d.pallas_triton": "BlockSizes",
    "ops.causal_conv1d.pallas_triton.config": "BlockSizes",
}


@pytest.mark.parametrize("module, old", sorted(CONFIGS.items()))
def test_a_config_under_its_old_name_warns(module, old):
    m = importlib.import_module(f"{PACKAGE}.{module}")
    assert old not in vars(m) and old not in m.__all__  # looked up, so that reading it warns
    with pytest.warns(DeprecationWarning, match=_deprecated(f"{m.__name__}.{old}", f"{m.__name__}.Config")):
        assert getattr(m, old) is m.Config
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        m.Nothing  # noqa: B018


def test_the_old_implementation_name_warns_and_runs_the_new_one():
    import maskconv_kernels as mk

    x, k, mask = np.ones((1, 4, 4, 2), np.float32), np.ones((3, 3, 2, 2), np.float32), mk.pixelcnn_mask((3, 3), "B")
    old, new = 'implementation="pallas"', 'implementation="pallas_triton"'
    with pytest.warns(DeprecationWarning, match=_deprecated(old, new)):
        y = mk.masked_conv(x, k, mask, implementation="pallas", interpret=True)
    np.testing.assert_array_equal(y, mk.masked_conv(x, k, mask, implementation="pallas_triton", interpret=True))


def test_the_package_imports_no_old_path():
    """Anywhere in its code, lazy imports included: the shim is for other code."""
    old = tuple(f"{PACKAGE}.{o}" for o in MOVED)
    found = []
    for name, path in _modules().items():
        for base, names in _import_nodes(name, path):
            found += [f"{name}: {t}" for t in [base, *(f"{base}.{n}" for n in names)]
                      if t in old or t.startswith(tuple(f"{o}." for o in old))]
    assert not found, found


def test_importing_and_calling_the_package_never_warns_its_own_deprecations():
    """Every module imported in a fresh interpreter (none imported before), then the ops
    called, with the shim's warnings as errors (other libraries' deprecations aside)."""
    code = (
        "import importlib, sys, warnings\n"
        "warnings.filterwarnings('error', '.* will be removed in maskconv-kernels', DeprecationWarning)\n"
        "import numpy as np, maskconv_kernels as mk\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError:  # an optional dependency (triton, jax's Mosaic GPU) missing here\n"
        "        pass\n"
        "x, k, m = np.ones((1, 5, 5, 2), np.float32), np.ones((3, 3, 2, 2), np.float32), np.ones((3, 3))\n"
        "mk.masked_conv(x, k, m)\n"
        "mk.masked_conv(x, k, m, implementation='pallas_triton', interpret=True)\n"
        "mk.causal_conv1d(np.ones((1, 8, 4), np.float32), np.ones((3, 4), np.float32))\n"
        "mk.causal_conv(np.ones((1, 8, 4), np.float32), np.ones((3, 4, 4), np.float32))\n"
    )
    # __main__ modules run a program when imported.
    names = sorted(n for n in _modules() if not n.endswith("__main__"))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_documented_names_import():
    import maskconv_kernels as mk
    from maskconv_kernels import parallel
    from maskconv_kernels.ops.masked_conv.decode import make_decode_spec

    for name in ("masked_conv", "causal_conv1d", "causal_conv1d_update", "causal_conv", "causal_conv_stream",
                 "pixelcnn_mask", "audit_causal", "assert_causal", "gpu_target"):
        assert callable(getattr(mk, name)), name
    assert callable(parallel.sequence_sharded_causal_conv1d) and callable(parallel.spatially_sharded_masked_conv)
    assert callable(make_decode_spec) and callable(mk.ops.causal_conv1d.causal_conv1d_update)
    from maskconv_kernels.compat.causal_conv1d import causal_conv1d_fn, causal_conv1d_update  # noqa: F401
    from maskconv_kernels.equinox import CausalConv, Conv2d  # noqa: F401
    from maskconv_kernels.flax import MaskedConv, ShortConv  # noqa: F401
    from maskconv_kernels.flax.linen import CausalConv as LinenCausalConv, Conv  # noqa: F401
    from maskconv_kernels.flax.nnx import CausalConv as NnxCausalConv, ShortConv as NnxShortConv  # noqa: F401
