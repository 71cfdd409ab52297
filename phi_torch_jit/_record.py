"""Stage 1: the untraced record pass.

The user function runs once, eagerly, inside a record frame. Meanwhile

* a global nn.Module forward pre-hook (installed only while at least one
  thread records, see :class:`_ModuleHook`) and :func:`register_module_call`
  collect every module that runs, so that the wrapper can hold it as a
  submodule and its parameters stay parameters in the trace;
* every custom-function call appends a :class:`RecordedCall` with copies of
  its inputs and outputs, which stage 2 compiles and the trace replays;
* buffers of each module are snapshotted before the module first runs, so
  the trace pass can be rewound (see :mod:`._state`).

The record pass is the real eager call: its result is what the first call
of a jitted function returns.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ._context import Phase, current_frame, recording_frame
from ._patches import RefCounted
from ._phiml import PhiMLBridge
from ._side_effects import print_capture
from ._state import StateSnapshot

if TYPE_CHECKING:
    from ._custom import CustomFunction

__all__ = [
    "RecordedCall",
    "Recording",
    "RunEagerly",
    "record",
    "register_module_call",
    "MODULE_HOOK",
]


class RunEagerly(Exception):
    """Internal signal: this specialization cannot be compiled faithfully; run it eagerly."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class RecordedCall:
    """One call of a custom function during the record pass."""

    function: CustomFunction
    """The custom function that was called."""
    args: tuple[Any, ...]
    """Its arguments: tensors as detached copies, other values as passed."""
    outputs: tuple[torch.Tensor, ...]
    """Detached copies of its outputs, returned again by the trace pass."""
    single: bool
    """Whether ``f`` returned a bare tensor rather than a tuple."""
    context: Any = None
    """The forward's per-call context for its backward (see NOTE [call context])."""

    @classmethod
    def of(
        cls, function: CustomFunction, args: tuple[Any, ...], outputs: Any, context: Any = None
    ) -> RecordedCall:
        """Record a call; tensors are copied so later in-place edits cannot leak in."""
        single = not isinstance(outputs, tuple)
        outs = (outputs,) if single else outputs
        copied = tuple(_copy(a) for a in args)
        return cls(function, copied, tuple(_copy(o) for o in outs), single, context)


@dataclass
class Recording:
    """What the record pass saw."""

    modules: dict[int, nn.Module] = field(default_factory=dict)
    """Modules that ran (or were registered), by id, in first-call order."""
    calls: list[RecordedCall] = field(default_factory=list)
    """Custom-function calls in call order."""
    state: StateSnapshot = field(default_factory=StateSnapshot)
    """RNG and buffer state from before the pass."""
    side_effects: list[str] = field(default_factory=list)
    """Python side effects seen (``print at file:line``) that compiled calls will not repeat."""
    phiml: PhiMLBridge = field(default_factory=PhiMLBridge)
    """Lets PhiML's torch backend see our record and trace passes as its jit."""
    eager_reasons: list[str] = field(default_factory=list)
    """Why the specialization must run eagerly (e.g. an uncapturable autograd.Function)."""

    def add_module(self, module: nn.Module) -> None:
        """Note that ``module`` runs in this call (idempotent)."""
        if id(module) not in self.modules:
            self.modules[id(module)] = module
            self.state.add_module(module)

    def add_call(
        self, function: CustomFunction, args: tuple[Any, ...], outputs: Any, context: Any = None
    ) -> None:
        """Append a custom-function call (see :meth:`RecordedCall.of`)."""
        self.calls.append(RecordedCall.of(function, args, outputs, context))

    def root_modules(self) -> list[nn.Module]:
        """Recorded modules that are not submodules of another recorded module."""
        inner: set[int] = set()
        for module in self.modules.values():
            inner.update(id(m) for m in module.modules() if m is not module)
        return [m for i, m in self.modules.items() if i not in inner]


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


class _ModuleHook:
    """A process-wide forward pre-hook, installed while at least one thread records.

    Every module call in the process pays for a global hook, so it is only
    present during record passes (reference counted: see :mod:`._patches`).
    """

    def __init__(self) -> None:
        self._handle: RemovableHandle | None = None
        self._patch = RefCounted(self._install, self._remove)

    @property
    def handle_id(self) -> int | None:
        """Id of the installed hook in torch's global pre-hook dict (None if not installed)."""
        handle = self._handle
        return handle.id if handle is not None else None

    def active(self) -> AbstractContextManager[None]:
        return self._patch.active()

    def _install(self) -> None:
        self._handle = nn.modules.module.register_module_forward_pre_hook(_on_module_call)

    def _remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def _on_module_call(module: nn.Module, args: Any) -> None:
    register_module_call(module)


_MODULE_HOOK = MODULE_HOOK = _ModuleHook()


def register_module_call(module: nn.Module) -> None:
    """Declare that ``module`` takes part in the jitted call being recorded.

    Call it inside ``forward`` (or any method) of a module whose parameters a
    jitted function uses without calling the module itself. Modules that are
    *called* are found automatically. Outside a record pass this is a no-op,
    so it costs a ContextVar read on compiled and eager calls.
    """
    frame = current_frame()
    if frame is not None and frame.phase is Phase.RECORD and frame.recording is not None:
        frame.recording.add_module(module)


def record(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    owner: str,
    modules: list[nn.Module],
) -> tuple[Any, Recording]:
    """Run ``fn`` eagerly in a record frame; return its result and what was recorded.

    ``modules`` (e.g. modules passed as arguments) are recorded up front.
    Exceptions from ``fn`` propagate unchanged.
    """
    recording = Recording()
    for module in modules:
        recording.add_module(module)
    with (
        _MODULE_HOOK.active(),
        print_capture(),
        recording_frame(owner, recording),
        recording.phiml.active(),
    ):
        result = fn(*args, **kwargs)
    return result, recording
