"""Sphinx configuration of handoff's documentation site (tools/build-docs builds it)."""

import doctest
import os
import sys

# The examples in the pages that use a device run on the simulated one; the backend is chosen once per
# process, before handoff first needs it, so set it before importing handoff.
os.environ.setdefault("HANDOFF_BACKEND", "sim")

import handoff

project = "handoff"
author = "the handoff authors"
copyright = "the handoff authors"
release = handoff.__version__  # the installed package's: the docs describe what is installed
version = ".".join(release.split(".")[:2])

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ext"))

extensions = [
    "myst_parser",
    "cpp_headers",  # docs/_ext/cpp_headers.py: the `cpp-header` directive of cpp-reference.md
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3  # `page.md#a-heading` links, as GitHub makes them

autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Every example in the pages runs (tools/build-docs: `-b doctest`); numbers that differ between runs
# are matched with `...`.
doctest_default_flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
doctest_global_setup = """
import numpy as np
import handoff
"""

html_theme = "furo"
html_title = f"handoff {release}"

# Warnings are errors (tools/build-docs: -W -n). These targets are outside the package: the standard
# library's and pybind11's classes (no intersphinx: the build reads nothing from the network).
nitpick_ignore = [
    ("py:class", "os.PathLike"),
    ("py:class", "CapsuleType"),
    ("py:class", "pybind11_builtins.pybind11_object"),
    ("py:class", "collections.abc.Sequence"),
    ("py:class", "collections.abc.Callable"),
    ("py:class", "contextlib.AbstractContextManager"),
    ("py:class", "collections.abc.Iterator"),
    ("py:class", "handoff._adapters.Target"),  # a private alias in LibraryAdapter's signature
]

# napoleon reads a property docstring's first words before a colon as its type ("NumPy's array
# interface v3: ..."); the package's property docstrings are plain prose, so they bypass napoleon.
_plain_docstrings: dict[str, list[str]] = {}


def _keep_plain(app, what, name, obj, options, lines):
    if what in ("property", "attribute"):
        _plain_docstrings[name] = list(lines)


def _restore_plain(app, what, name, obj, options, lines):
    if name in _plain_docstrings:
        lines[:] = _plain_docstrings.pop(name)


def setup(app):
    app.connect("autodoc-process-docstring", _keep_plain, priority=100)  # before napoleon (500)
    app.connect("autodoc-process-docstring", _restore_plain, priority=900)
