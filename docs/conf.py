"""Sphinx configuration for the faultlab documentation (Markdown pages, read by myst-parser)."""

from __future__ import annotations

import sys
from pathlib import Path

# Document the package from this checkout, installed or not.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

project = "faultlab"
author = "the faultlab authors"
copyright = "the faultlab authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# Headings become link targets, so pages can link to "page.md#a-heading".
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

html_theme = "alabaster"
html_static_path: list[str] = []
