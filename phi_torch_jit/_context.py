"""The per-call state of a jitted call, held in one ContextVar.

While a jitted function is specialized, its Python runs twice: once untraced
to *record* (modules called, custom-function calls) and once under the tracer
to *trace*, replaying the recording. Code deep inside user functions
(custom functions, the module pre-hook, nested jitted functions) must know
which phase is active. That knowledge lives in one :class:`Frame`, stored in a
``contextvars.ContextVar`` so that threads and asyncio tasks each see their
own, and changed only by the context managers below, which restore the
previous value in ``finally`` -- an exception in user code leaves nothing
behind.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._intercept import function_capture
from ._warnings import torchscript_notices_hidden

if TYPE_CHECKING:
    from ._custom_op import NestedCalls
    from ._record import Recording
    from ._replay import ReplayCursor
    from ._value_guards import Conversion

__all__ = [
    "Phase",
    "Frame",
    "current_frame",
    "recording_frame",
    "tracing_frame",
    "compiling_frame",
    "no_frame",
    "inside_custom_function",
]


class Phase(enum.Enum):
    """Which pass of a specialization is running."""

    RECORD = "record"
    """The untraced run that discovers modules and custom-function calls."""
    TRACE = "trace"
    """The traced run that replays the recording."""
    COMPILE = "compile"
    """A custom function's forward or backward is being compiled; custom functions it calls
    become nested compiled calls (see :class:`._custom_op.NestedCalls`)."""


@dataclass(frozen=True)
class Frame:
    """State of the jitted call that is being specialized in this context."""

    phase: Phase
    """Which pass is running."""
    owner: str
    """The jitted user function, as ``name (file:line)``, for messages."""
    recording: Recording | None = None
    """Where the record pass stores what it sees (record phase only)."""
    cursor: ReplayCursor | None = None
    """Hands out recorded custom calls in order (trace phase only)."""
    nested: NestedCalls | None = None
    """Compiles custom functions called inside the one being compiled (compile phase only)."""
    conversions: list[Conversion] | None = None
    """Tensor-to-Python conversions made by user code (trace phase, when value guards are on)."""


_FRAME: ContextVar[Frame | None] = ContextVar("phi_torch_jit_frame", default=None)


def current_frame() -> Frame | None:
    """The frame of the jitted call being specialized here, or None outside one."""
    return _FRAME.get()


@contextmanager
def _entered(frame: Frame | None) -> Iterator[Frame | None]:
    token = _FRAME.set(frame)
    try:
        if frame is None:
            yield frame
        else:  # autograd.Function calls inside the frame are captured (see _intercept)
            with function_capture(), torchscript_notices_hidden():
                yield frame
    finally:
        _FRAME.reset(token)


def recording_frame(owner: str, recording: Recording) -> AbstractContextManager[Frame | None]:
    """Enter the record phase for ``owner``; ``recording`` collects what runs."""
    return _entered(Frame(Phase.RECORD, owner, recording=recording))


def tracing_frame(
    owner: str, cursor: ReplayCursor, conversions: list[Conversion] | None = None
) -> AbstractContextManager[Frame | None]:
    """Enter the trace phase for ``owner``; ``cursor`` replays the recording.

    ``conversions``, if given, collects the tensor-to-Python conversions of user code.
    """
    return _entered(Frame(Phase.TRACE, owner, cursor=cursor, conversions=conversions))


def no_frame() -> AbstractContextManager[Frame | None]:
    """Run a block as if no jitted call were being specialized or compiled."""
    return _entered(None)


def compiling_frame(owner: str, nested: NestedCalls) -> AbstractContextManager[Frame | None]:
    """Enter the compile phase: custom functions called now become nested compiled calls."""
    return _entered(Frame(Phase.COMPILE, owner, nested=nested))


def inside_custom_function() -> AbstractContextManager[Frame | None]:
    """Run the body of a custom function (its ``f`` or ``gradient``).

    What it calls belongs to that function, not to the surrounding jitted
    function, so record and trace frames are hidden. A compile frame stays
    visible: custom functions called by a function being compiled are
    compiled too (e.g. the adjoint solve inside a gradient).
    """
    frame = _FRAME.get()
    return _entered(frame if frame is not None and frame.phase is Phase.COMPILE else None)
