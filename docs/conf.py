"""Sphinx configuration: MyST pages and an API reference generated from the docstrings.

Build (warnings are errors, as CI builds it): ``pip install ".[docs]" && python -m sphinx -W -b html docs docs/_build/html``
"""
from __future__ import annotations

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
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
autosummary_generate = False
nitpicky = False

html_theme = "sphinx_book_theme"
html_title = "maskconv-kernels"
html_theme_options = {"show_toc_level": 2}
