"""Stage 4: trace the wrapper while the replay cursor hands out the recorded custom calls.

The order of what happens around a trace matters and lives here, in one function:

1. module buffers and the RNG are rewound to their state before the record pass
   (:meth:`._state.StateSnapshot.rewound`), so the trace leaves no side effect;
2. inside that, the trace phase is entered (frame and patches: :func:`._phases.tracing`),
   the engine compiles the wrapper on copies of the inputs, and the cursor checks that
   every recorded call was replayed (:meth:`._replay.ReplayCursor.finish`);
3. still rewound but outside the frame, the engine's warm-up runs (a backend's compile);
4. a :class:`Traced` is returned: the compiled module, its value guards, the structure of
   the result the trace saw, and the time it took.

Stage 2 (compiling the custom calls, :func:`._custom_op.compile_calls`) runs before this
and needs to know whether the chosen engine captures a graph; see ``_jit``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ._compat import any_autocast
from ._context import Converted
from ._custom_op import ReplayStep
from ._phases import tracing
from ._record import Recording
from ._replay import ReplayCursor
from ._signature import Spec
from ._value_guards import ValueGuard, value_guards
from ._wrapper import WrapperModule
from .engines import CompiledModule, Engine
from .errors import TraceError, ValueNotCaptured

__all__ = ["Traced", "trace", "trace_input"]


@dataclass(frozen=True)
class Traced:
    """What stage 4 produced for one specialization."""

    module: CompiledModule
    """The compiled wrapper (its notes include the engine's warm-up notes)."""
    value_guards: tuple[ValueGuard, ...]
    """Tensor values the traced Python branched on; checked after each compiled call."""
    output_spec: Spec
    """Structure of the result as the trace saw it (compared with the recorded one)."""
    seconds: float
    """Time spent tracing, warm-up included."""
    buffer_writes: tuple[torch.Tensor, ...] = ()
    """Buffers the function replaced; their new values follow the program's other outputs."""
    deferred: tuple[Any, ...] = ()
    """PhiML ``when_available`` callbacks, called with their tensors after each call."""


def trace_input(t: torch.Tensor) -> torch.Tensor:
    """A copy of an input for the trace pass, so in-place edits do not reach the caller's
    tensor, with the input's strides (``clone`` makes a view with gaps, ``x[:, 0]``,
    contiguous: Python reading ``stride()`` or ``is_contiguous()`` would see another layout
    than the signature's)."""
    detached = t.detach()
    if type(detached) is not torch.Tensor:  # a subclass: its own rules (isinstance reads)
        return detached.clone().requires_grad_(t.requires_grad)
    copy = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    try:
        copy.copy_(detached)
    except RuntimeError:  # overlapping strides (an expanded tensor): a dense copy
        copy = detached.clone()
    return copy.requires_grad_(t.requires_grad)


@contextmanager
def _fresh_autocast_cache() -> Iterator[None]:
    """Under autocast, casts of parameters are cached: the record pass's cached casts would
    enter the trace as constants, and the trace's would leak into later eager code."""
    if not any_autocast():  # the same test as the cache key's
        yield
        return
    torch.clear_autocast_cache()
    try:
        yield
    finally:
        torch.clear_autocast_cache()


def _unguarded_value_message(owner: str) -> str:
    return (
        f"phi_torch_jit: {owner} turns a tensor into a Python value (if on a tensor, int(), "
        "float(), .item(), .tolist()) and value guards are off, so engine 'compile' cannot "
        "capture it: with jit(on_guard_failure='off') only engine 'torchscript' bakes the "
        "traced branch. Use on_guard_failure='retrace' (the default), or tensor operations "
        "such as torch.where."
    )


def trace(
    engine: Engine,
    steps: list[ReplayStep],
    recording: Recording,
    wrapper: WrapperModule,
    tensors: list[torch.Tensor],
    guarding: bool,
) -> Traced:
    """Trace ``wrapper`` with ``engine``, replaying ``steps``; see the module docstring.

    ``guarding``: collect tensor-to-Python conversions of user code as value guards.
    """
    start = time.perf_counter()
    cursor = ReplayCursor(steps, wrapper.owner)
    example = tuple(trace_input(t) for t in tensors)
    conversions: list[Converted] | None = [] if guarding else None
    with recording.state.rewound(), _fresh_autocast_cache():
        with tracing(wrapper.owner, cursor, conversions, recording.libraries) as frame:
            try:
                compiled = engine.compile_module(wrapper, example, wrapper.owner)
            except ValueNotCaptured:
                if guarding:  # a conversion inside a torch op: the signal's reason says so
                    raise
                raise TraceError(_unguarded_value_message(wrapper.owner)) from None
        cursor.finish()
        # NOTE [value-dependent sizes]: sizes the graph left dynamic are no path
        dynamic = compiled.sizes_left_dynamic
        branches = [c for c in conversions or () if not (dynamic and c.sized)]
        if branches and compiled.defer is not None:  # a path of values: compile on reuse
            notes = compiled.defer(len(branches))
        elif compiled.warm_up is not None:  # a run on the trace inputs: no SolveTape sees it
            with recording.libraries.outside_user_call():
                notes = compiled.warm_up()
        else:
            notes = ()
    assert frame.outputs.spec is not None, "the wrapper's forward did not run"
    notes = (*compiled.notes, *notes)
    served = compiled.served if branches and compiled.defer is not None else None
    compiled = dataclasses.replace(compiled, notes=notes, warm_up=None, defer=None, served=served)
    guards = value_guards(conversions or [], dynamic)
    seconds = time.perf_counter() - start
    writes = frame.outputs.buffer_writes
    deferred = tuple(frame.outputs.deferred)
    return Traced(compiled, guards, frame.outputs.spec, seconds, writes, deferred)
