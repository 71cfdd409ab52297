"""Notice Python side effects that compiled calls will not repeat.

A compiled call runs no Python of the jitted function, so a ``print`` in it
follows JAX's rule: it happens once per compile, in the record pass (the
eager run whose result the first call returns), never in the trace pass and
never on compiled calls; eager specializations print on every call, as eager
code does. While a record or trace pass runs, ``builtins.print`` is replaced
by a function that notes user code's calls in the recording and drops them
in the trace pass (reference counted across threads like the module hook;
other threads' prints pass through). Changes of state the step reads are
found by :mod:`._reads._mutations`.
"""

from __future__ import annotations

import builtins
from typing import Any

from ._context import Phase, current_frame
from ._patches import RefCounted
from ._sources import user_location

__all__ = ["print_capture"]

_ORIGINAL_PRINT = builtins.print


def _print(*args: Any, **kwargs: Any) -> None:
    frame = current_frame()
    if frame is not None and frame.phase is Phase.RECORD and frame.recording is not None:
        location = user_location(1)  # who called print
        if location is not None:
            frame.recording.side_effects.append(f"print at {location}")
    elif frame is not None and frame.phase is Phase.TRACE and user_location(1) is not None:
        return  # the record pass of this call printed it already: once per compile
    _ORIGINAL_PRINT(*args, **kwargs)


def _install() -> None:
    builtins.print = _print


def _remove() -> None:
    builtins.print = _ORIGINAL_PRINT


_CAPTURE = RefCounted(_install, _remove)


def print_capture() -> Any:
    """Context manager: note ``print`` calls of user code in record frames, drop them in
    trace frames, while active."""
    return _CAPTURE.active()
