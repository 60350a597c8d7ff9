"""Sphinx configuration: MyST pages and an API reference generated from the docstrings.

Build (warnings are errors, as CI builds it): ``pip install ".[docs]" && python -m sphinx -W -b html docs docs/_build/html``
"""
from __future__ import annotations

import re

import maskconv_kernels

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
autodoc_default_options = {"members": True, "show-inheritance": False}
autosummary_generate = False
nitpicky = False

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
            indent = len(line) - len(line.lstrip())
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


def setup(app):
    # Before napoleon (priority 500) turns the sections into fields.
    app.connect("autodoc-process-docstring", _join_wrapped_names, priority=400)
