"""Sphinx configuration: the guides are Markdown (MyST), the API reference comes from the docstrings."""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "hpcsync"
author = "the hpcsync developers"
copyright = "2026, the hpcsync developers"
extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
html_theme = "alabaster"
html_static_path: list = []
