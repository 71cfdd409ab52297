"""Stage 1: the untraced record pass.

The user function runs once, eagerly, inside a record frame. Meanwhile

* a global nn.Module forward pre-hook (installed only while at least one
  thread records, see :mod:`._phases`) and :func:`register_module_call`
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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._compat import global_module_hooks
from ._context import CustomCallee, note_module_call
from ._custom import CustomFunction
from ._libraries import LibraryPasses
from ._phases import recording as recording_phase
from ._state import StateSnapshot
from ._unguardable import Unguardable
from .errors import TraceError

__all__ = ["RecordedCall", "Recording", "record", "register_module_call", "check_modules"]


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
    libraries: LibraryPasses = field(default_factory=LibraryPasses)
    """The registered libraries' hooks around the record and trace passes (PhiML's torch
    backend sees them as its jit)."""
    eager_reasons: list[str] = field(default_factory=list)
    """Why the specialization must run eagerly (e.g. an uncapturable autograd.Function)."""
    unguardable: Unguardable = field(default_factory=Unguardable)
    """Calls of user code that no compiled program repeats (random draws, clocks, grad-mode
    changes, tensor hooks), noted by the phase's patches."""
    used: set[int] = field(default_factory=set)
    """Ids of the tensors torch calls of the pass were given, by anyone's code (a property
    read, ``t.shape``, is a call): a global tensor not among them plays no part in the
    program (``_reads.unused_tensors``)."""

    def tensors_used(self, outputs: Sequence[torch.Tensor]) -> set[int] | None:
        """Ids of the tensors the program may use: those the pass's torch calls were given
        and those it returned. None (any may be) where Python of the step can run later, in a
        backward: a custom function's, a module's or torch's global backward hooks."""
        if self.calls or any(map(any, global_module_hooks()[2:])):
            return None
        for module in self.modules.values():
            if module._backward_hooks or module._backward_pre_hooks:
                return None
            if isinstance(module, torch.jit.ScriptModule):  # its ops are not seen
                return None
        return self.used | {id(t) for t in outputs}

    def add_module(self, module: nn.Module) -> None:
        """Note that ``module`` runs in this call (idempotent); on a later call, buffers it
        holds that were not seen yet (its own, given back after ``functional_call`` lent it
        others for its first call) are remembered too."""
        if id(module) not in self.modules:
            self.modules[id(module)] = module
            self.state.add_module(module)
        else:
            self.state.add_values(module._buffers.values())

    def before_write(self, tensor: torch.Tensor) -> None:
        """Keep ``tensor``'s value before the pass writes it in place (see ``_state``)."""
        self.state.before_write(tensor)

    @property
    def made(self) -> set[int]:
        """Ids of the tensors the pass made (``_param_writes.note_made``)."""
        return self.state.made

    def lent_to_numpy(self, tensor: torch.Tensor) -> None:
        """``tensor.numpy()`` ran in the pass (see ``_state``)."""
        self.state.lent_to_numpy(tensor)

    @property
    def aliases(self) -> dict[int, torch.Tensor]:
        """Aliases the pass made -> the tensors they alias (``_param_writes.note_made``)."""
        return self.state.aliases

    def add_call(
        self, function: CustomCallee, args: tuple[Any, ...], outputs: Any, context: Any = None
    ) -> None:
        """Append a custom-function call (see :meth:`RecordedCall.of`)."""
        assert isinstance(function, CustomFunction), "frames hand on custom functions only"
        self.calls.append(RecordedCall.of(function, args, outputs, context))

    def root_modules(self, read: Sequence[nn.Module] = ()) -> list[nn.Module]:
        """Recorded modules, and ``read`` ones whose forward may not have run (a closure's
        ``model.log_prob(z)``), that are not submodules of another of them."""
        every = {**self.modules, **{id(m): m for m in read}}
        inner: set[int] = set()
        for module in every.values():
            inner.update(id(m) for m in module.modules() if m is not module)
        return [m for i, m in every.items() if i not in inner]


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def register_module_call(module: nn.Module) -> None:
    """Declare that ``module`` takes part in the jitted call being recorded.

    Call it inside ``forward`` (or any method) of a module whose parameters a
    jitted function uses without calling the module itself. Modules that are
    *called* are found automatically. Outside a record pass this is a no-op,
    so it costs a ContextVar read on compiled and eager calls.
    """
    note_module_call(module)


def record(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    owner: str,
    modules: list[nn.Module],
    known: Sequence[nn.Module] = (),
) -> tuple[Any, Recording]:
    """Run ``fn`` eagerly in a record frame; return its result and what was recorded.

    ``modules`` (e.g. modules passed as arguments) are recorded up front. ``known``: modules
    reachable before the call (arguments, globals, closures); which buffers they hold is
    noted, so that buffers lent to them for a while are not taken for replaced ones.
    Exceptions from ``fn`` propagate unchanged.
    """
    recording = Recording()
    recording.state.hold([*modules, *known])
    for module in modules:
        recording.add_module(module)
    with recording_phase(owner, recording):  # patches: see _phases.PATCHES
        result = fn(*args, **kwargs)
    recording.state.reinstate()
    if recording.state.written_unseen():
        recording.eager_reasons.append(
            "it writes a tensor through a NumPy view (t.numpy()), which no torch call sees and a "
            "compiled program would not repeat; write it with torch ops to have it compiled"
        )
    return result, recording


def check_modules(recording: Recording, owner: str) -> None:
    """Refuse modules a compiled program cannot stand for: DDP/DataParallel do per-call
    Python work (gradient-reduction bookkeeping, buffer broadcasts) it would skip.

    See docs/distributed.md: the supported pattern jits the step *inside* the module that
    DistributedDataParallel wraps, so DDP's own forward runs around the compiled call.
    """
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    for module in recording.modules.values():
        if isinstance(module, wrappers):
            raise TraceError(
                f"phi_torch_jit: {owner} calls a {type(module).__name__} module. Its forward "
                "does per-call work (gradient-reduction bookkeeping, buffer broadcasts) that a "
                "compiled program would skip, so gradients would silently not be averaged. Jit "
                "the step inside the module instead and wrap that module: "
                "DistributedDataParallel(Trainer(net)) where Trainer.forward calls the jitted "
                "step (see docs/distributed.md)."
            )
