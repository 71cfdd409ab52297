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

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["function_capture", "original_apply"]

_FUNCTION = torch.autograd.Function
_ORIGINAL = _FUNCTION.__dict__["apply"]  # the classmethod object
_original_func = _ORIGINAL.__func__


def original_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``cls.apply(*args)`` as torch defines it, bypassing the interception."""
    return _original_func(cls, *args, **kwargs)


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    from . import _function  # imported late: _function depends on most of the package

    return _function.dispatch(cls, args, kwargs)


class _Capture:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0

    @contextmanager
    def active(self) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                _FUNCTION.apply = classmethod(_apply)  # type: ignore[assignment,method-assign]
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    _FUNCTION.apply = _ORIGINAL  # type: ignore[method-assign]


_CAPTURE = _Capture()


def function_capture() -> Any:
    """Context manager: intercept ``Function.apply`` while the block runs (reference counted)."""
    return _CAPTURE.active()
