"""Whose code is this: the user's, torch's or ours?

Value guards, the print notice and tracer-warning filtering all need to tell
user code from library code; they ask here.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from typing import Any

import torch

__all__ = ["TORCH_DIR", "OWN_DIR", "user_location", "is_user_file"]

TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
"""Directory of the torch package (trailing separator)."""
OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
"""Directory of phi_torch_jit (trailing separator)."""


def user_location(depth: int, skip_torch: bool = False) -> str | None:
    """``file:line`` of the frame ``depth`` levels above the caller, or None if that frame is
    torch's or phi_torch_jit's own code (``depth=1``: whoever called the caller).

    ``skip_torch``: look past torch's frames first (a conversion torch makes for the user, such
    as ``Tensor.__array__`` calling ``numpy()``).
    """
    frame: Any = sys._getframe(depth + 1)
    while (
        skip_torch and frame.f_back is not None and frame.f_code.co_filename.startswith(TORCH_DIR)
    ):
        frame = frame.f_back
    filename = frame.f_code.co_filename
    if filename.startswith((TORCH_DIR, OWN_DIR)):
        return None
    return f"{filename}:{frame.f_lineno}"


_LIBRARY_DIRS = tuple(
    os.path.realpath(d) + os.sep
    for d in {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    if d
)
_NOT_USER = (
    *{os.path.realpath(d) + os.sep for d in (TORCH_DIR, OWN_DIR)},
    *_LIBRARY_DIRS,
)
_USER: dict[str, bool] = {}


def is_user_file(filename: str) -> bool:
    """Whether code from ``filename`` is the user's: not torch's, not ours, not the standard
    library's or an installed package's (and not generated: ``<string>``, ``<frozen ...>``)."""
    known = _USER.get(filename)
    if known is None:
        path = os.path.realpath(filename) if not filename.startswith("<") else ""
        known = _USER[filename] = bool(path) and not path.startswith(_NOT_USER)
    return known
