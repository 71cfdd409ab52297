"""Stages 1-5 for one cache miss, in order (the numbering of docs/design.md).

1. :func:`._record.record` -- the untraced run; its result is what the call returns;
2. :func:`._custom_op.compile_calls` -- each recorded custom call's forward compiled into an op;
3. :func:`._wrapper.make_wrapper` -- a module holding the recorded modules' tensors;
4. :func:`._trace.trace` -- the engine traces the wrapper while the recording replays;
5. a :class:`._specialization.Specialization`, guarded by a :class:`._guards.ModuleGuard`.

A specialization that cannot be compiled faithfully (backward hooks, an autograd.Function
that cannot be captured, a per-call closure passed to a custom function) runs the Python
function instead: :class:`~.errors.RunEagerly` carries the reason, logged once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ._custom_op import CompiledCall, compile_calls
from ._explain import Reporter
from ._guards import ModuleGuard, has_backward_hooks
from ._options import Options
from ._record import Recording, check_modules, record
from ._signature import Spec, describe_spec, flatten_outputs, modules_in
from ._specialization import Key, Specialization, Timings
from ._state import rng_restored
from ._trace import Traced, trace, wrapper_engine
from ._wrapper import WrapperModule, make_wrapper, module_names
from .engines import CompiledModule
from .errors import RunEagerly, TraceError

__all__ = ["Target", "specialize"]


@dataclass(frozen=True)
class Target:
    """The jitted function the pipeline specializes."""

    fn: Callable[..., Any]
    """The user's function."""
    owner: str
    """It, as ``name (file:line)``."""
    options: Options
    """What ``jit()`` was asked for."""
    report: Reporter
    """Its logs and warnings."""


def specialize(
    target: Target, key: Key, args: Any, kwargs: Any, tensors: list[torch.Tensor]
) -> tuple[Any, Specialization]:
    """The stages for a cache miss; return (the eager result, the specialization)."""
    start = time.perf_counter()
    result, recording = record(target.fn, args, kwargs, target.owner, modules_in(key[0]))
    output_spec, outputs = flatten_outputs(result, target.owner)
    record_s = time.perf_counter() - start
    check_modules(recording, target.owner)
    modules = recording.root_modules()
    wrapper = make_wrapper(target.fn, key[0], modules, target.owner)
    eager_reason = _eager_reason(recording)
    traced: Traced | None = None
    calls: tuple[CompiledCall, ...] = ()
    compile_s = 0.0
    if not eager_reason:
        try:
            traced, calls, compile_s = _compile(target, recording, wrapper, tensors)
        except RunEagerly as signal:
            eager_reason = signal.reason
    if eager_reason:  # custom functions run eagerly inside the wrapper's forward
        target.report.runs_eagerly(eager_reason)
        traced, calls = Traced(CompiledModule(wrapper.forward), (), output_spec, 0.0), ()
    else:
        target.report.side_effects(recording.side_effects)
    assert traced is not None
    _check_structure(target.owner, traced.output_spec, output_spec)
    return result, Specialization(
        key=key,
        program=traced.module.run,
        output_spec=output_spec,
        modules=tuple(module_names(modules)),
        calls=calls,
        timings=Timings(record_s, compile_s, traced.seconds),
        tracer_warnings=target.report.tracer_warnings(traced.module),
        guard=ModuleGuard(modules, target.options.guard_hooks) if modules else None,
        eager_reason=eager_reason,
        value_guards=traced.value_guards,
        n_outputs=len(outputs),
        buffers=tuple(b for m in modules for b in m.buffers()) if traced.value_guards else (),
        uses_rng=traced.module.uses_rng,
        engine_notes=traced.module.notes,
    )


def _compile(
    target: Target, recording: Recording, wrapper: WrapperModule, tensors: list[torch.Tensor]
) -> tuple[Traced, tuple[CompiledCall, ...], float]:
    """Stages 2 and 4: (what the trace produced, the distinct compiled calls, stage 2's s)."""
    requested = target.options.engine
    engine, note = wrapper_engine(requested, recording)
    start = time.perf_counter()
    with rng_restored():
        steps = compile_calls(recording.calls, requested, engine.captures_graph)
    compile_s = time.perf_counter() - start
    guarding = target.options.on_guard_failure != "off"
    traced = trace(engine, steps, recording, wrapper, tensors, guarding, note)
    calls = tuple({id(s.compiled): s.compiled for s in steps}.values())
    return traced, calls, compile_s


def _eager_reason(recording: Recording) -> str:
    """Why a specialization must run eagerly, known after the record pass ("" if none)."""
    reasons = list(recording.eager_reasons)
    if has_backward_hooks(recording.modules.values()):
        reasons.append("a module it calls has backward hooks, which a compiled program cannot fire")
    return "; ".join(reasons)


def _check_structure(owner: str, traced: Spec, recorded: Spec) -> None:
    if traced != recorded:
        raise TraceError(
            f"phi_torch_jit: {owner} returned a different structure while tracing "
            f"({describe_spec(traced)}) than while recording ({describe_spec(recorded)}). "
            "Make the output structure depend only on the inputs' shapes and static values."
        )
