"""Sphinx configuration: MyST pages and an API reference generated from the docstrings.

Build (warnings are errors, as CI builds it): ``pip install ".[docs]" && python -m sphinx -W -b html docs docs/_build/html``
"""
from __future__ import annotations

import importlib
import re
import sys
import types

from sphinx.util.inspect import TypeAliasForwardRef

import maskconv_kernels
from maskconv_kernels._moved import MOVED

project = "maskconv-kernels"
release = version = maskconv_kernels.__version__
copyright = "the maskconv-kernels authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# Google-style docstrings ("Args:", "Returns:", "Raises:").
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# "Attributes:" as fields of the class, not as attribute entries that would repeat the
# dataclass fields autodoc documents.
napoleon_use_ivar = True
# "Returns: ``y``: (B, L, D) ..." names the value, not its type: render it inline.
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# jax.typing.ArrayLike by its name, not its expansion (Array | ndarray | bool | number | ...).
autodoc_type_aliases = {"jax.typing.ArrayLike": "jax.typing.ArrayLike", "ArrayLike": "jax.typing.ArrayLike"}
# Inside a union (``jax.typing.ArrayLike | None``) Sphinx writes such an alias as the repr of
# its placeholder, "TypeAliasForwardRef('jax.typing.ArrayLike')": make that the alias's name.
TypeAliasForwardRef.__repr__ = lambda self: self.name
autodoc_default_options = {"members": True, "show-inheritance": False}
autosummary_generate = False
# Every reference must resolve (a stale one to a moved module is an error with -W)...
nitpicky = True
# ...but those to other projects' types cannot without intersphinx, which would fetch their
# inventories over the network at every build: the annotations name them as plain text.
nitpick_ignore_regex = [(r"py:class", r"(jax|numpy|flax|equinox|collections\.abc)\..*")]

html_theme = "sphinx_book_theme"
html_title = "maskconv-kernels"
html_theme_options = {"show_toc_level": 2}


# A Google-style "Args:" entry naming several arguments may wrap its list of names onto the
# next line ("strides, padding, dilation,\n  precision: as in masked_conv"); napoleon reads
# each line as a new entry. Join such a list before napoleon parses the section.
_FIELD_SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Attributes|Keyword Args|Other Parameters):\s*$")
_CODE = re.compile(r"``.*?``|`.*?`")


def _wrapped_name_list(line: str) -> bool:
    return ":" not in _CODE.sub("", line) and line.rstrip().endswith(",")


def _join_wrapped_names(app, what, name, obj, options, lines):
    out, i, section, item = [], 0, None, None
    while i < len(lines):
        line = lines[i]
        header = _FIELD_SECTION.match(line)
        if header:
            section, item = len(header.group(1)), None
        elif section is not None and line.strip():
            indent = _indent(line)
            if indent <= section:
                section = None
            else:
                item = indent if item is None else item
                while indent == item and _wrapped_name_list(line) and i + 1 < len(lines) and lines[i + 1].strip():
                    i += 1
                    line = f"{line.rstrip()} {lines[i].strip()}"
        out.append(line)
        i += 1
    lines[:] = out


# napoleon gives each name of an "a, b: ..." entry its own field under "Args:", but keeps the
# list whole under "Attributes:" (``:ivar a, b:``), where Sphinx reads "a," as b's type, a
# reference to nothing. Give each name the entry there too, as under "Args:".
_NAME_LIST = re.compile(r"^(\s*)(\w+(?:, \w+)+):(.*)$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _split_attribute_lists(app, what, name, obj, options, lines):
    out, i, section, item = [], 0, None, None
    while i < len(lines):
        line = lines[i]
        header = _FIELD_SECTION.match(line)
        if header:
            section, item = (len(header.group(1)) if header.group(2) == "Attributes" else None), None
        elif section is not None and line.strip():
            if _indent(line) <= section:
                section = None
            else:
                item = _indent(line) if item is None else item
                names = _NAME_LIST.match(line) if _indent(line) == item else None
                if names:
                    end = i + 1
                    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > item):
                        end += 1
                    while end > i + 1 and not lines[end - 1].strip():
                        end -= 1
                    for each in names.group(2).split(", "):
                        out += [f"{names.group(1)}{each}:{names.group(3)}", *lines[i + 1 : end]]
                    i = end
                    continue
        out.append(line)
        i += 1
    lines[:] = out


# A reference the Python domain cannot resolve (nitpicky makes that an error), when it names a
# module or object of this package by its real path, relative to the module it is written in
# as the docstrings write them (``:func:`.api.causal_conv```): linked where the API reference
# documents that object, under whatever name (``maskconv_kernels.causal_conv``), else written
# as its name, as without nitpicky (a module no page documents). One that names nothing, or
# names an old path that maskconv_kernels._moved keeps working, stays an error: a stale one.
_PACKAGE = maskconv_kernels.__name__
_MISSING = object()
_DOCUMENTED: dict[int, dict[int, str]] = {}  # id(env) -> {id(object): its documented name}


def _ours(obj) -> bool:
    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None) or ""
    return name == _PACKAGE or name.startswith(_PACKAGE + ".")


def _old_path(name: str) -> bool:
    return any(name == f"{_PACKAGE}.{old}" or name.startswith(f"{_PACKAGE}.{old}.") for old in MOVED)


def _lookup(name: str):
    """The module or object of this package that ``name`` names, or ``_MISSING``: found in the
    namespaces of the package's own modules and classes only, never through a shim."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if _old_path(".".join(parts[:i])):
            return _MISSING
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not _ours(obj) or not isinstance(obj, (types.ModuleType, type)):
                return _MISSING
            members = {**getattr(obj, "__dataclass_fields__", {}), **vars(obj)}
            if attr not in members:
                return _MISSING
            obj = members[attr]
        data = not isinstance(obj, (types.ModuleType, type, types.FunctionType))
        return obj if data or _ours(obj) else _MISSING
    return _MISSING


def _documented(env) -> dict[int, str]:
    if id(env) not in _DOCUMENTED:
        found = {}
        for name, entry in env.domains["py"].objects.items():
            obj = _MISSING if entry.aliased else _lookup(name)
            if isinstance(obj, (types.ModuleType, type, types.FunctionType)):  # data: no identity
                found.setdefault(id(obj), name)
        _DOCUMENTED[id(env)] = found
    return _DOCUMENTED[id(env)]


def _written_in(node) -> str:
    """The module whose docstring holds ``node``: autodoc names the object, by its own module,
    in the source (``...: docstring of maskconv_kernels.ops.causal_conv.stream.causal_conv_stream``),
    which the API reference may document under another module (``maskconv_kernels``)."""
    while node is not None and not node.source:
        node = node.parent
    name = node.source.partition("docstring of ")[2] if node is not None else ""
    while name and name not in sys.modules:
        name = name.rpartition(".")[0]
    return name


def _candidates(node) -> list[str]:
    """The full names ``node``'s target may mean: itself, then relative to each module scope."""
    target = node["reftarget"].lstrip(".").removesuffix("()")
    names = [target]
    for module in (_written_in(node), node.get("py:module") or ""):
        if node.get("py:class"):
            names.append(f"{module}.{node['py:class']}.{target}")
        scopes = module.split(".")
        names += [".".join(scopes[:i] + [target]) for i in range(len(scopes), 0, -1)]
    return [n for n in names if n.startswith(_PACKAGE + ".")]


def _resolve_own(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    for name in _candidates(node):
        obj = _lookup(name)
        if obj is _MISSING:
            continue
        documented = _documented(env).get(id(obj))
        if documented is None:
            return contnode
        domain = env.domains["py"]
        resolved = domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], documented, node, contnode)
        return resolved or contnode
    return None


def setup(app):
    # Before napoleon (priority 500) turns the sections into fields, in this order.
    app.connect("autodoc-process-docstring", _join_wrapped_names, priority=400)
    app.connect("autodoc-process-docstring", _split_attribute_lists, priority=401)
    app.connect("missing-reference", _resolve_own)
