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
    _ORIGINAL_PRINT(*args, **kwargs)


def _install() -> None:
    builtins.print = _print


def _remove() -> None:
    builtins.print = _ORIGINAL_PRINT


_CAPTURE = RefCounted(_install, _remove)


def print_capture() -> Any:
    """Context manager: note ``print`` calls of user code in record frames while active."""
    return _CAPTURE.active()
