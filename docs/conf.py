"""Sphinx configuration: a MyST (Markdown) site with autodoc for the API page.

Build with ``sphinx-build -W -b html docs docs/_build/html``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(".."))  # the checkout, when the package is not installed

from einshard import __version__  # noqa: E402

project = "torch-einshard"
author = "torch-einshard developers"
copyright = "torch-einshard developers"  # noqa: A001
release = __version__
version = ".".join(__version__.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False}

html_theme = "furo"
html_title = f"torch-einshard {release}"
