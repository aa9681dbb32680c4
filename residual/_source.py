"""Whose code a source file is: the user's, this library's or another installed one's.

Reports point at the user's code: their frame walks (a residual's provenance, its
source line in `inspect` and `peak`) skip the files this module calls the library's.
"""

from __future__ import annotations

import os
import sys
import sysconfig

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# The demo plays the user's part in `python -m residual demo`: its lines are shown.
_DEMO = os.path.join(PACKAGE_DIR, "_demo.py")

_LIBRARIES = tuple(
    os.path.join(sysconfig.get_paths()[key], "") for key in ("stdlib", "purelib", "platlib")
)


def is_own_file(file_name: str) -> bool:
    """Whether `file_name` is this library's code (the demo, which plays the user, is not)."""
    return file_name != _DEMO and file_name.startswith(PACKAGE_DIR)


def is_library(file_name: str) -> bool:
    """Whether `file_name` is this library's, Python's or an installed package's code."""
    if file_name.startswith(PACKAGE_DIR):
        return is_own_file(file_name)
    return (file_name.startswith(_LIBRARIES)
            or f"{os.sep}site-packages{os.sep}" in file_name
            or f"{os.sep}dist-packages{os.sep}" in file_name)


def file_label(file_name: str) -> str:
    """`model.py`, or `In[3]` for a notebook cell (IPython names cells by temp files)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    named = getattr(getattr(shell, "compile", None), "format_code_name", lambda _: None)
    cell = named(file_name)
    return cell[1] if cell else os.path.basename(file_name)
