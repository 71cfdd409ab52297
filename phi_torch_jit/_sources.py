"""Whose code is this: the user's, torch's or ours?

Value guards, the print notice and tracer-warning filtering all need to tell
user code from library code; they ask here.
"""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["TORCH_DIR", "OWN_DIR", "user_location"]

TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
"""Directory of the torch package (trailing separator)."""
OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
"""Directory of phi_torch_jit (trailing separator)."""


def user_location(depth: int) -> str | None:
    """``file:line`` of the frame ``depth`` levels above the caller, or None if that frame is
    torch's or phi_torch_jit's own code (``depth=1``: whoever called the caller)."""
    frame = sys._getframe(depth + 1)
    filename = frame.f_code.co_filename
    if filename.startswith((TORCH_DIR, OWN_DIR)):
        return None
    return f"{filename}:{frame.f_lineno}"
