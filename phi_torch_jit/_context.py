"""The per-call state of a jitted call: one frame in a ContextVar, one call state per thread.

While a jitted function is specialized, its Python runs twice: once untraced to *record*
(modules called, custom-function calls) and once under the tracer to *trace*, replaying the
recording. Code deep inside user functions (custom functions, the module pre-hook, nested
jitted functions) must know which phase is active. That knowledge lives in one :class:`Frame`,
stored in a ``contextvars.ContextVar`` so that threads and asyncio tasks each see their own.
The frame is set only by :func:`entered` (which :mod:`._phases` wraps with the phase's
patches) and restored in ``finally``: an exception in user code leaves nothing behind.

Custom ops also run on compiled calls, where no frame exists, and torch's dispatcher calls
their implementation and their autograd ``setup_context`` one after the other with no way to
pass a value between them. What a custom-function call hands from one step to the next lives
in this thread's :class:`CallState` (NOTE [call state] in docs/design.md): one documented
object, not a side channel per need.

This module is a leaf: it imports nothing else of the package, not even for type hints. What a
frame holds is typed by the protocols below, which the stages' own classes satisfy (the
recording, the replay cursor, the PhiML bridge...): each names only what is used of it through
a frame, so no import circle runs through the frame.
"""

from __future__ import annotations

import enum
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "raised_by_check",
    "Phase",
    "Frame",
    "TraceOutputs",
    "ValueSized",
    "CustomCallee",
    "UnguardableNotes",
    "Recorder",
    "CustomCalls",
    "Converted",
    "LibraryHooks",
    "current_frame",
    "entered",
    "no_frame",
    "inside_custom_function",
    "CustomBody",
    "custom_body",
    "note_module_call",
    "Replaying",
    "CallState",
    "call_state",
]


class Phase(enum.Enum):
    """Which pass of a specialization is running (the stage numbers of docs/design.md)."""

    RECORD = "record"
    """Stage 1: the untraced run that discovers modules and custom-function calls."""
    TRACE = "trace"
    """Stage 4: the traced run that replays the recording."""
    COMPILE = "compile"
    """Stage 2 (and at the first backward): a custom function's forward or backward is being
    compiled; custom functions it calls become nested compiled calls
    (see :class:`._custom_op.NestedCalls`)."""


@dataclass
class TraceOutputs:
    """What the traced wrapper found out about its result (trace phase)."""

    spec: tuple[Any, ...] | None = None
    """Structure of the user function's result (a ``_signature.Spec``), set when the wrapper's
    forward returns."""
    deferred: list[Any] = field(default_factory=list)
    """Callbacks a library deferred to after each compiled call (PhiML's ``when_available``,
    ``adapters.phiml``), each with ``count`` and ``call(tensors)``; the
    program returns their tensors after the value-guard tensors."""
    deferred_tensors: list[torch.Tensor] = field(default_factory=list)
    """The traced tensors the deferred callbacks receive, in order."""
    buffer_writes: tuple[torch.Tensor, ...] = ()
    """Buffers the function replaced by new tensors (``self.avg = ...``): the program returns
    their new values after its other outputs, to be copied into these objects."""


@dataclass
class ValueSized:
    """Tensors of one trace whose sizes come from tensor values (``nonzero``, a boolean index,
    and what was computed from them) and the Python reads of those sizes: NOTE [value-dependent
    sizes]. Keyed by ``id``; the tensors are held until the trace ends."""

    tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    reads: list[str] = field(default_factory=list)
    """Where Python read such a size (``len(idx)``, ``x.shape``): the graph bakes it."""
    nodes: list[Any] = field(default_factory=list)
    """The graph nodes holding those sizes (each notes in its meta whether a size was read)."""
    watching: bool = False
    """Whether this trace has the size reads watched (:mod:`._value_sized`)."""


@dataclass(frozen=True)
class Frame:
    """State of the jitted call that is being specialized in this context."""

    phase: Phase
    """Which pass is running."""
    owner: str
    """The jitted user function, as ``name (file:line)``, for messages."""
    recording: Recorder | None = None
    """Where the record pass stores what it sees (record phase only)."""
    cursor: CustomCalls | None = None
    """Hands out recorded custom calls in order (trace phase only)."""
    nested: CustomCalls | None = None
    """Compiles custom functions called inside the one being compiled (compile phase only)."""
    conversions: list[Converted] | None = None
    """Tensor-to-Python conversions made by user code (trace phase, when value guards are on)."""
    libraries: LibraryHooks | None = None
    """The registered libraries' hooks around this pass (record and trace phases)."""
    outputs: TraceOutputs = field(default_factory=TraceOutputs)
    """Filled by the wrapper while it is traced; the trace stage returns it."""
    sized: ValueSized = field(default_factory=ValueSized)
    """Tensors whose sizes come from values (trace phase)."""
    new_functions: weakref.WeakSet[type] = field(default_factory=weakref.WeakSet)
    """``autograd.Function`` classes created while this pass ran (a class defined inside the
    step: a new one in every pass; ``_function``)."""


# What a frame holds, as the code below the stages that build it sees it: each protocol names
# the class that satisfies it (module docstring).


class CustomCallee(Protocol):
    """A custom function as a frame hands it on: a ``_custom.CustomFunction``, which that module
    (above this one) defines; a stage that keeps the function asserts the class."""

    label: str
    """``name (file:line)``, for messages."""


class UnguardableNotes(Protocol):
    """What a record pass saw that no compiled program repeats (``_unguardable.Unguardable``;
    its lists of places are also filled by name)."""

    per_call_functions: list[str]
    imports: dict[str, str]
    type_tests: dict[tuple[type, type], bool]
    random: list[str]
    state_dicts: dict[int, str]

    @property
    def layout_reads(self) -> dict[int, str]: ...  # a LayoutReads (with its strides)


class Recorder(Protocol):
    """Where the record pass notes what runs (``_record.Recording``)."""

    side_effects: list[str]
    eager_reasons: list[str]

    @property
    def unguardable(self) -> UnguardableNotes: ...

    @property
    def libraries(self) -> LibraryHooks: ...

    def add_module(self, module: nn.Module) -> None: ...

    def before_write(self, tensor: torch.Tensor) -> None:
        """``tensor`` (not made by the pass) is about to be written in place by the pass."""

    @property
    def made(self) -> set[int]:
        """Ids of the tensors torch calls of the pass made (their writes need no rewinding)."""
        ...

    def lent_to_numpy(self, tensor: torch.Tensor) -> None:
        """``tensor.numpy()`` ran in the pass: NumPy may write it unseen."""

    @property
    def aliases(self) -> dict[int, torch.Tensor]:
        """Id of an alias a torch call made (``p.data``) -> the tensor it aliases."""
        ...

    @property
    def used(self) -> set[int]:
        """Ids of the tensors torch calls of the pass were given (``note_used``)."""
        ...

    def add_call(
        self, function: CustomCallee, args: tuple[Any, ...], outputs: Any, context: Any = None
    ) -> None: ...


class CustomCalls(Protocol):
    """Takes the custom-function calls of a trace pass (``_replay.ReplayCursor``) or of a body
    being compiled (``_custom_op.NestedCalls``)."""

    def call(self, function: CustomCallee, args: tuple[Any, ...]) -> tuple[Any, Any]:
        """(the call's outputs, as ``f`` returns them, its call context)."""


class Converted(Protocol):
    """A tensor traced user code turned into a Python value (``_value_guards.Conversion``)."""

    @property
    def tensor(self) -> torch.Tensor: ...

    @property
    def kind(self) -> str: ...

    @property
    def value(self) -> Any: ...

    @property
    def location(self) -> str: ...

    @property
    def sized(self) -> bool: ...


class LibraryHooks(Protocol):
    """The registered libraries' hooks around a pass (``_libraries.LibraryPasses``)."""

    def active(self, recording: bool = False) -> AbstractContextManager[Any]: ...


_FRAME: ContextVar[Frame | None] = ContextVar("phi_torch_jit_frame", default=None)


current_frame: Callable[[], Frame | None] = _FRAME.get
"""The frame of the jitted call being specialized here, or None outside one (the ContextVar's
own C-level getter: read on every jitted call)."""


@contextmanager
def entered(frame: Frame | None) -> Iterator[Frame | None]:
    """Make ``frame`` current while the block runs (patches: see :mod:`._phases`)."""
    token = _FRAME.set(frame)
    try:
        yield frame
    finally:
        _FRAME.reset(token)


def no_frame() -> AbstractContextManager[Frame | None]:
    """Run a block as if no jitted call were being specialized or compiled."""
    return entered(None)


@dataclass(frozen=True)
class CustomBody:
    """The body of a custom function running in a record pass (its frame hidden)."""

    recording: Recorder
    """The record pass's recording."""
    inputs: frozenset[int]
    """Ids of the tensors the body was given (it may write them: ``ctx.mark_dirty``)."""
    label: str
    """The custom function, ``name (file:line)``."""


_BODY: ContextVar[CustomBody | None] = ContextVar("phi_torch_jit_body", default=None)

custom_body: Callable[[], CustomBody | None] = _BODY.get
"""The custom function body running in this context's record pass, if any (the record phase's
watches note what it writes besides its inputs: ``_param_writes``)."""


@contextmanager
def inside_custom_function(inputs: Sequence[Any] = (), label: str = "") -> Iterator[Frame | None]:
    """Run the body of a custom function (its ``f`` or ``gradient``, given ``inputs``).

    What it calls belongs to that function, not to the surrounding jitted
    function, so record and trace frames are hidden. A compile frame stays
    visible: custom functions called by a function being compiled are
    compiled too (e.g. the adjoint solve inside a gradient). In a record pass the body is
    noted (:func:`custom_body`).
    """
    frame = _FRAME.get()
    body = None
    if frame is not None and frame.phase is Phase.RECORD and frame.recording is not None:
        ids = frozenset(id(t) for t in inputs if isinstance(t, torch.Tensor))
        body = _BODY.set(CustomBody(frame.recording, ids, label))
    try:
        with entered(frame if frame is not None and frame.phase is Phase.COMPILE else None) as kept:
            yield kept
    finally:
        if body is not None:
            _BODY.reset(body)


def note_module_call(module: Any) -> None:
    """Tell the record pass running here, if any, that ``module`` takes part in it."""
    frame = _FRAME.get()
    if frame is not None and frame.phase is Phase.RECORD and frame.recording is not None:
        frame.recording.add_module(module)


@dataclass(frozen=True)
class Replaying:
    """The custom op call that the trace pass is replaying now."""

    call: object
    """The compiled call whose op is being recorded into the trace (compared by identity)."""
    outputs: tuple[torch.Tensor, ...]
    """The recorded outputs the op returns instead of computing."""
    context: Any
    """The recorded call context, handed to the op's autograd formula."""


class CallState(threading.local):
    """What one thread's custom-function calls hand from one step to the next.

    See NOTE [call state] in docs/design.md. Each field has one writer and one reader.
    """

    replaying: Replaying | None = None
    """Set by ``CompiledCall.replay`` around its op call; read by the op's implementation."""
    pending_context: Any = None
    """Call context of the op call that just ran; taken by its autograd ``setup_context``."""
    last_context: Any = None
    """Call context left by the latest custom forward run in this thread (an
    autograd.Function's ctx layout; None for plain custom functions)."""
    last_error: BaseException | None = None
    """The exception a Python forward raised inside a compiled program, until the caller
    re-raises it unchanged (TorchScript reports it as a RuntimeError)."""
    check_error: BaseException | None = None
    """The exception a library's check on a compiled forward's values raised (PhiML's
    ``Diverged``), until the specialization asks whether its error was one."""


_STATE = CallState()


def call_state() -> CallState:
    """This thread's :class:`CallState`."""
    return _STATE


def raised_by_check(error: BaseException) -> bool:
    """Whether ``error`` (raised by a compiled program, or TorchScript's RuntimeError
    reporting it) came from a library's check on a custom forward's values rather than from
    running it; taken only once."""
    state = _STATE
    checked, state.check_error = state.check_error, None
    if checked is None:
        return False
    message = str(checked)
    if checked is not error and not (message and message in str(error)):  # TorchScript's report
        return False
    if state.last_error is checked:
        state.last_error = None
    return True
