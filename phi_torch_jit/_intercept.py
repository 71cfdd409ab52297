"""Route ``torch.autograd.Function.apply`` through phi_torch_jit while a jitted call is built.

Plain ``autograd.Function`` subclasses are called through ``Function.apply``,
a classmethod on torch's base class. While at least one thread is inside a
record, trace or compile frame, that classmethod is replaced by
:func:`_apply`, which hands calls made *inside such a frame* to
:mod:`._function` and every other call (other threads, eager code) to the
original unchanged. The replacement is reference counted across threads and
removed when the last frame closes, so code outside jit never sees it (and
torch.compile, which recognizes ``Function.apply``, is not disturbed).
"""

from __future__ import annotations

from typing import Any

import torch

from ._compat import original_function_apply
from ._patches import RefCounted

__all__ = ["function_capture", "original_apply", "interception_installed"]

_FUNCTION = torch.autograd.Function
_ORIGINAL = _FUNCTION.__dict__["apply"]  # a classmethod (torch 2.13) or its C twin (2.15)
_original_apply = original_function_apply(_ORIGINAL)


def original_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``cls.apply(*args)`` as torch defines it, bypassing the interception."""
    return _original_apply(cls, *args, **kwargs)


def interception_installed() -> bool:
    """Whether ``Function.apply`` is replaced now (some thread is inside a jit frame)."""
    return _FUNCTION.__dict__["apply"] is not _ORIGINAL


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    from . import _function  # imported late: _function depends on most of the package

    return _function.dispatch(cls, args, kwargs)


def _install() -> None:
    _FUNCTION.apply = classmethod(_apply)  # type: ignore[assignment,method-assign]


def _remove() -> None:
    _FUNCTION.apply = _ORIGINAL  # type: ignore[method-assign]


_CAPTURE = RefCounted(_install, _remove)


def function_capture() -> Any:
    """Context manager: intercept ``Function.apply`` while the block runs (reference counted)."""
    return _CAPTURE.active()
