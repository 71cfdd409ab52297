"""Notice Python side effects that compiled calls will not repeat.

A compiled call runs no Python of the jitted function, so a ``print`` in it
happens on the first call only (twice, in fact: record and trace pass).
While a record pass runs, ``builtins.print`` is replaced by a function that
notes calls made by user code in the recording (reference counted across
threads like the module hook; other threads' prints pass through). Other
side effects -- appending to a list, mutating globals -- cannot be seen and
are listed in docs/troubleshooting.md.
"""

from __future__ import annotations

import builtins
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ._context import Phase, current_frame

__all__ = ["print_capture"]

_ORIGINAL_PRINT = builtins.print
_SKIP = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.abspath(__file__)))


def _print(*args: Any, **kwargs: Any) -> None:
    frame = current_frame()
    if frame is not None and frame.phase is Phase.RECORD and frame.recording is not None:
        caller = sys._getframe(1)
        filename = caller.f_code.co_filename
        if not filename.startswith(_SKIP):
            frame.recording.side_effects.append(f"print at {filename}:{caller.f_lineno}")
    _ORIGINAL_PRINT(*args, **kwargs)


class _PrintCapture:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0

    @contextmanager
    def active(self) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                builtins.print = _print
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    builtins.print = _ORIGINAL_PRINT


_CAPTURE = _PrintCapture()


def print_capture() -> Any:
    """Context manager: note ``print`` calls of user code in record frames while active."""
    return _CAPTURE.active()
