"""Sphinx configuration: the guides are Markdown (MyST), the API reference comes from the docstrings."""
import importlib
import os
import sys

sys.path.insert(0, os.path.abspath(".."))


def _missing(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return True
    return False


# autodoc imports every module it documents. The packages hpcsync uses that may not be installed
# where the docs are built (Lightning is optional, and `pip install -r docs/requirements.txt` in a
# fresh venv brings Sphinx alone) are mocked; where a package is there, the real one is used.
autodoc_mock_imports = [name for name in ("numpy", "psutil", "torch", "mpi4py", "h5py", "lightning") if _missing(name)]

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
