"""Stages 1-5 for one cache miss, in order (the numbering of docs/design.md).

1. :func:`._record.record` -- the untraced run; its result is what the call returns;
2. :func:`._custom_op.compile_calls` -- each recorded custom call's forward compiled into an op;
3. :func:`._wrapper.make_wrapper` -- a module holding the recorded modules' tensors;
4. :func:`._trace.trace` -- the engine traces the wrapper while the recording replays;
5. a :class:`._specialization.Specialization`, guarded by a :class:`._guards.ModuleGuard`.

A specialization that cannot be compiled faithfully (backward hooks, an uncapturable autograd
Function) runs the Python function instead: :class:`~.errors.RunEagerly` says why, logged once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._ambient import eager_around, modes_around, overrides_torch_function
from ._compat import torchscript_available
from ._custom_op import CompiledCall, compile_calls
from ._explain import Reporter
from ._guards import ModuleGuard, has_backward_hooks
from ._meter import Meter
from ._options import Options
from ._reads import CachedCalls, PythonGuard, collect_reads
from ._reads._code_walk import user_class
from ._reads._hooks import held_by_hooks, hook_reads
from ._reads._kinds import generator_of
from ._reads._mutations import Changing, modules_known_before, snapshot
from ._reads._overflow import Overflow
from ._reads._records import Kind, Read
from ._reads._unread import Unread
from ._reads._written_inputs import WrittenInputs, aliased, versions, written_inputs
from ._record import Recording, check_modules, record
from ._registries import Registries
from ._signature import (
    Spec,
    callables_in,
    classes_in,
    converts_natives,
    count_program_outputs,
    flatten_outputs,
    merge_traced_numbers,
    modules_in,
    unflatten_arguments,
)
from ._spec_text import describe_spec
from ._specialization import EagerCall, Key, Specialization, Timings
from ._state import module_tensors, rng_restored, undone
from ._trace import Traced, trace, trace_input
from ._unguardable import Unguardable
from ._wrapper import WrapperModule, make_wrapper, module_names
from .engines import CompiledModule, Engine, get_engine
from .errors import NotNow, ReplayError, RunEagerly, TraceError, WalkFailed, describe_error

__all__ = ["Target", "specialize", "eager_specialization", "VALUE_SPECIALIZATIONS"]

VALUE_SPECIALIZATIONS = 4
"""Specializations one signature may have for tensor values its Python branched on (``while
float(t) < t1``): a signature whose values change the path on every call would compile per call
and run each cached program before missing; past this many, it runs eagerly: NOTE [values that
never repeat]."""


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
    changing: Changing = field(default_factory=Changing)
    """Record passes in a row that changed the Python state they read."""
    unread: Unread = field(default_factory=Unread)
    """Attributes that changed between calls, watched in record passes (counters)."""
    overflow: Overflow = field(default_factory=Overflow)
    """Objects past the walk's limits, watched in record passes."""


def specialize(
    target: Target, key: Key, args: Any, kwargs: Any, tensors: list[torch.Tensor]
) -> tuple[Any, Specialization | None]:
    """The stages for a cache miss; return (the eager result, the specialization), or
    (the eager result, None) when the engine cannot compile without making the caller wait.
    A walk of the state it reads that fails after the record pass (any of them: the step's,
    its hooks', its cached functions' results) keeps that pass's result, eager from then."""
    recorded: list[Any] = []
    try:
        return _specialize(target, key, args, kwargs, tensors, recorded)
    except WalkFailed as failed:  # before the record pass: the caller runs the function
        if not recorded:
            raise
        target.report.cannot_compile([failed.reason])
        return recorded[0], eager_specialization(target, key, failed.reason)


def _specialize(
    target: Target,
    key: Key,
    args: Any,
    kwargs: Any,
    tensors: list[torch.Tensor],
    recorded: list[Any],
) -> tuple[Any, Specialization | None]:
    if converts_natives(key[0]):  # the record pass must see what the trace sees
        args, kwargs = unflatten_arguments(key[0], tensors)
    callables = [*callables_in(key[0]), *filter(user_class, classes_in(key[0]))]
    before = snapshot(target.fn, modules_in(key[0]), callables)
    start = time.perf_counter()  # the record pass: an eager run (NOTE [never slower than eager])
    written_before = versions(tensors)
    as_called = _as_called(tensors)
    with target.unread.watching(), target.overflow.watching(), CachedCalls(before.reads) as cached:
        result, recording = record(target.fn, args, kwargs, target.owner, modules_in(key[0]),
                                   before.modules)  # fmt: skip
    recorded.append(result)
    written = written_inputs(tensors, written_before)
    output_spec, outputs = flatten_outputs(result, target.owner)
    record_s = time.perf_counter() - start
    check_modules(recording, target.owner)
    recording.eager_reasons.extend(cached.unrepeatable())  # NOTE [cached calls]
    watched = target.options.side_effects == "eager"
    changed = before.changes() if watched else []
    if not target.changing.settled(key, bool(changed)):  # NOTE [side effects of the step]
        return result, None
    held, drawn = before.drawn() if watched else (set(), set())
    notes = recording.unguardable
    imported = notes.imports, notes.module_reads, notes.state_dicts, notes.type_tests
    customs = [getattr(getattr(f, "__self__", None), "cls", f)  # an adapted Function: its class
               for c in recording.calls for f in (c.function.f, c.function.gradient)]  # fmt: skip
    with target.overflow.walking():
        reads = collect_reads(target.fn, list(recording.modules.values()), callables,
                              *imported, customs=customs, overflow=target.overflow)  # fmt: skip
    if target.overflow.look_again():  # past the walk's limits: the next call watches them
        return result, None
    hooks_read = hook_reads(list(recording.modules.values()), reads)  # kept unless the trace
    by_dict = {id(m.__dict__): m for m in recording.modules.values()}
    reads = [*reads, *hooks_read]
    target.unread.discard(reads, bool(recording.calls))  # a backward reads later, unwatched
    reads = target.unread.kept(reads, by_dict)
    target.report.unguarded(reads)
    used = recording.tensors_used(outputs)  # a global tensor no op was given is no input
    guard = PythonGuard(reads, used) if reads else None
    captured = [r.source for r in guard.tensors] if guard is not None else []
    modules = recording.root_modules(modules_known_before(target.fn, guard.reads if guard else ()))
    wrapper = make_wrapper(target.fn, key[0], modules, target.owner, captured)
    quiet = held - drawn  # generators held but not drawn from in the record pass
    eager_reason = _eager_reason(target, recording, changed, written, reads, quiet)
    overriding = overrides_torch_function([*tensors, *(guard.captured() if guard else ())])
    state_written = tuple(recording.state.written())
    inputs = [*tensors, *(guard.captured() if guard else ()), *module_tensors(modules)]
    if target.options.engine.captures_graph and aliased(recording.state.changed(), inputs):
        overriding = ("it writes a tensor that shares memory with another of its inputs "
                      "(an alias kept from an earlier call?), read apart by a graph")  # fmt: skip
    modes = modes_around(key[2])
    if modes:
        overriding = (f"a torch-function mode of yours is active around the call ({modes}), "
                      "which a captured program would not run")  # fmt: skip
    overriding = eager_around(key[2]) or overriding  # saved-tensor hooks, cached parametrizations
    if overriding and not eager_reason:  # NOTE [eager, never a crash]
        eager_reason = _cannot_trace(target, overriding)
    traced: Traced | None = None
    calls: tuple[CompiledCall, ...] = ()
    compile_s = 0.0
    if not eager_reason:
        arguments = tensors if written is None else as_called  # the trace sees them unwritten
        inputs = [*arguments, *(guard.captured() if guard is not None else ())]
        registries, failure = Registries([*recording.modules.values(), *before.modules]), ""
        try:
            traced, calls, compile_s = _compile(target, recording, wrapper, inputs)
        except NotNow:
            registries.added_back_out()
            return result, None
        except RunEagerly as signal:  # what the engine cannot compile faithfully: warned
            failure = signal.reason
        except (TraceError, ReplayError) as error:  # our diagnosis, with a fix
            message = str(error).removeprefix("phi_torch_jit: ").removeprefix(target.owner)
            failure = message.strip().rstrip(".")
        except Exception as error:
            failure = (f"engine {target.options.engine.name!r} could not trace it: "
                       f"{describe_error(error)}")  # fmt: skip
        if added := registries.added_back_out():  # the trace did it again: NOTE [side effects once]
            failure = (f"it changes {added[0]} on every run, which compiled calls would not; "
                       "register it once, outside")  # fmt: skip
        if failure:
            eager_reason = _cannot_trace(target, failure)
    if guard is not None and target.options.side_effects == "trace":  # as the trace left it
        reads = collect_reads(target.fn, list(recording.modules.values()), callables, *imported,
                              customs=customs, overflow=target.overflow)  # fmt: skip
        guard = PythonGuard(target.unread.kept([*reads, *hooks_read], by_dict), used)
    if guard is not None and hooks_read:  # what a hook changed in the trace pass is its own
        guard = PythonGuard(held_by_hooks(guard.reads, hooks_read), used)
    guard = cached.guarded(guard, used)  # the caches of cached functions: NOTE [cached calls]
    if traced is None:  # custom functions run eagerly inside the wrapper's forward
        traced, calls = Traced(CompiledModule(wrapper.forward), (), output_spec, 0.0), ()
    else:
        target.report.side_effects(recording.side_effects)
    try:
        program_spec = _program_spec(target.owner, traced.output_spec, output_spec)
    except TraceError as error:  # the trace returned other structures: NOTE [eager, never a crash]
        message = str(error).removeprefix("phi_torch_jit: ").removeprefix(target.owner)
        eager_reason = eager_reason or _cannot_trace(target, message.strip().rstrip("."))
        program_spec = output_spec
    timings = Timings(record_s, compile_s, traced.seconds)
    n_outputs = count_program_outputs(program_spec)
    parts = _Parts(key, modules, traced, calls, timings, n_outputs, eager_reason, guard, written,
                   recording.unguardable, state_written)  # fmt: skip
    return result, _assemble(target, program_spec, parts)


@dataclass(frozen=True)
class _Parts:
    """What the stages produced, for stage 5."""

    key: Key
    modules: list[nn.Module]
    traced: Traced
    calls: tuple[CompiledCall, ...]
    timings: Timings
    n_outputs: int
    eager_reason: str
    python_guard: PythonGuard | None
    written: WrittenInputs | None
    reads: Unguardable  # where Python read a requires_grad or a layout (the module guard's)
    state_written: tuple[torch.Tensor, ...]
    """Tensors the record pass wrote besides arguments (``StateSnapshot.written``)."""


def _assemble(target: Target, output_spec: Spec, parts: _Parts) -> Specialization:
    """Stage 5: the specialization and its guards."""
    traced, modules, reads = parts.traced, parts.modules, parts.reads
    live = not parts.eager_reason  # eager code reads every state live: nothing to guard,
    # but backward hooks removed make the next call compiled again (probe 53b)
    hooked = not live and has_backward_hooks(m for root in modules for m in root.modules())
    guarded = bool(modules) and (live or hooked)
    module_guard = ModuleGuard(modules, target.options.guard_hooks, reads.grad_reads,
        target.unread.unread, reads.layout_reads) if guarded else None  # fmt: skip
    measured = target.options.fallback == "measure"
    if traced.module.keep_alive is not None:  # engine "auto" compiles after this call
        traced.module.keep_alive(parts.calls)
    return Specialization(
        key=parts.key,
        program=traced.module.run,
        output_spec=output_spec,
        modules=tuple(module_names(modules)),
        calls=parts.calls,
        timings=parts.timings,
        tracer_warnings=target.report.tracer_warnings(traced.module),
        guard=module_guard,
        eager_reason=parts.eager_reason,
        value_guards=traced.value_guards,
        n_outputs=parts.n_outputs,
        buffers=undone(modules, parts.state_written) if traced.value_guards else (),
        uses_rng=traced.module.uses_rng,
        engine_notes=traced.module.notes,
        engine_status=traced.module.describe,
        wait_engine=traced.module.wait,
        close_engine=traced.module.close,
        python_guard=parts.python_guard if live else None,
        buffer_writes=traced.buffer_writes,
        deferred=traced.deferred,
        eager=EagerCall(target.fn, parts.key[0]) if parts.eager_reason else None,
        meter=_meter(target, parts, traced.module) if live and measured else None,
        written=parts.written,
        python=EagerCall(target.fn, parts.key[0], parts.modules),
        served=traced.module.served,
        warn=target.report.cannot_compile,
    )


def _meter(target: Target, parts: _Parts, module: CompiledModule) -> Meter:
    """Times the compiled calls against eager's (NOTE [never slower than eager]), afresh when
    another program takes over (engine "auto"'s compiled tier)."""
    eager = EagerCall(target.fn, parts.key[0], parts.modules)
    uncompiled = any(n.endswith("the captured graph runs uncompiled") for n in module.notes)
    meter = Meter(eager, parts.timings.record, target.report.switched, compiled=not uncompiled)
    if module.on_new_program is not None:
        module.on_new_program(meter.restart)
    return meter


def eager_specialization(target: Target, key: Key, reason: str) -> Specialization:
    """A specialization that runs the Python function for ``key``, with no guards (eager code
    reads every state live); logged once and shown by ``explain()`` with ``reason``."""
    return Specialization(
        key=key,
        program=_no_program,
        output_spec=key[0],
        modules=(),
        calls=(),
        timings=Timings(0.0, 0.0, 0.0),
        tracer_warnings=(),
        guard=None,
        eager_reason=target.report.runs_eagerly(reason),
        eager=EagerCall(target.fn, key[0]),
    )


def eager_run(target: Target, key: Key) -> Callable[[list[torch.Tensor]], Any]:
    """Runs ``target``'s Python function on the flat inputs of ``key``'s signature."""
    return EagerCall(target.fn, key[0])


def _no_program(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    raise AssertionError("an eager specialization has no program")  # never called: eager=


def _as_called(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The arguments as the caller passed them, for the trace in case the record pass writes
    them in place: copies of those it could write (a leaf that requires grad cannot be
    written). Traced on the written values, a branch on them took the record pass's path
    after the write, and the first program failed its value guard on the next call (NOTE
    [arguments written in place])."""
    return [t if t.requires_grad and t.is_leaf else trace_input(t) for t in tensors]


def _compile(
    target: Target, recording: Recording, wrapper: WrapperModule, tensors: list[torch.Tensor]
) -> tuple[Traced, tuple[CompiledCall, ...], float]:
    """Stages 2 and 4: (what the trace produced, the distinct compiled calls, stage 2's s).

    A PhiML program that the requested graph-capturing engine cannot capture faithfully (a
    sparse matrix built with ``bincount``: a shape that depends on values) is traced by
    TorchScript where it exists and the engine may use it (``torchscript=True``: engine
    "compile", not "auto"), as before PhiML's custom gradients could be captured; the note says
    so in ``explain()``. Otherwise it runs eagerly."""
    engine = target.options.engine
    try:
        return _compile_with(engine, target, recording, wrapper, tensors)
    except RunEagerly as signal:
        may_script = (  # TorchScript's tracer has no gradient capture
            engine.captures_graph
            and getattr(engine, "torchscript", False)
            and not recording.unguardable.gradients
        )
        if not (recording.libraries.used and may_script and torchscript_available()):
            raise
        note = f"engine {engine.name!r} used 'torchscript': {signal.reason}"
    traced, calls, compile_s = _compile_with(
        get_engine("torchscript"), target, recording, wrapper, tensors
    )
    module = dataclasses.replace(traced.module, notes=(*traced.module.notes, note))
    return dataclasses.replace(traced, module=module), calls, compile_s


def _compile_with(
    engine: Engine,
    target: Target,
    recording: Recording,
    wrapper: WrapperModule,
    tensors: list[torch.Tensor],
) -> tuple[Traced, tuple[CompiledCall, ...], float]:
    start = time.perf_counter()
    with rng_restored():
        steps = compile_calls(recording.calls, engine, engine.captures_graph)
    compile_s = time.perf_counter() - start
    guarding = target.options.on_guard_failure != "off"
    traced = trace(engine, steps, recording, wrapper, tensors, guarding)
    calls = tuple({id(s.compiled): s.compiled for s in steps}.values())
    return traced, calls, compile_s


def _cannot_trace(target: Target, reason: str) -> str:
    """A trace failed after the record pass ran the function: it runs eagerly, warned once.

    NOTE [eager, never a crash]: the record pass is an eager run that succeeded, so whatever
    the tracer or a backend rejects is our limitation, not the user's error."""
    target.report.cannot_compile([reason])
    return target.report.runs_eagerly(reason)


def _eager_reason(
    target: Target,
    recording: Recording,
    changed: list[str],
    written: WrittenInputs | None,
    reads: Sequence[Read],
    quiet: Set[int] = frozenset(),
) -> str:
    """Why a specialization must run eagerly, known after the record pass ("" if none).

    Warned about once per jitted function, with a JitWarning that names the reasons
    (NOTE [eager, never a crash]), and logged. ``changed``: the user state the record pass
    changed (NOTE [side effects of the step]);
    ``written``: the arguments it wrote in place (NOTE [arguments written in place]);
    ``reads``: what it reads from Python (an iterator, a clock or a generator among them
    makes it eager; ``quiet``: the ids of generators held but not drawn from, which do not).
    """
    reasons = list(recording.eager_reasons)
    if has_backward_hooks(recording.modules.values()):
        reasons.append("a module it calls has backward hooks, which a compiled program cannot fire")
    engine = target.options.engine
    reasons += recording.unguardable.reasons(
        engine.name, engine.keeps_grad_mode, engine.keeps_functorch, engine.captures_autograd
    )
    if changed:
        reasons.append(
            f"it changes Python state it reads ({', '.join(changed[:3])}), which a compiled "
            "program would not repeat; keep such state outside the jitted function (pass it "
            "in as an argument and return its new value) to have it compiled"
        )
    iterators = [f"{r.source.label} (read at {r.source.location})" for r in reads
                 if r.kind is Kind.ITERATOR]  # fmt: skip
    if iterators:
        reasons.append(
            f"it reads an iterator ({', '.join(iterators[:3])}), whose next items a compiled "
            "program would not take; pass the item in as an argument to have it compiled"
        )
    drawn = [f"{r.source.label} (read at {r.source.location})" for r in reads
             if r.kind is Kind.DRAWS and id(generator_of(r.expected)) not in quiet]  # fmt: skip
    if drawn:
        reasons.append(
            f"it reads a random generator or a clock or a stream ({', '.join(drawn[:3])}), "
            "whose next values a compiled program would repeat; pass random values, times and "
            "loaded data as tensor arguments, or draw from torch's RNG (no generator=)"
        )
    if written is not None and written.aliased and target.options.engine.captures_graph:
        reasons.append(
            f"it writes an argument in place ({written.describe()}) that shares memory with "
            "another argument, which a captured graph (engines 'compile', 'auto') reads as "
            "separate; pass separate tensors (x.clone()) to have it compiled"
        )
    if not reasons:
        return ""
    target.report.cannot_compile(reasons)
    return target.report.runs_eagerly("; ".join(reasons))


def _program_spec(owner: str, traced: Spec, recorded: Spec) -> Spec:
    """The output spec the program serves: the recorded one, with numbers the trace computed
    as tensors made computed leaves (:func:`._signature.merge_traced_numbers`)."""
    merged = merge_traced_numbers(recorded, traced)
    if merged is None:
        raise TraceError(
            f"phi_torch_jit: {owner} returned a different structure while tracing "
            f"({describe_spec(traced)}) than while recording ({describe_spec(recorded)}). "
            "Make the output structure depend only on the inputs' shapes and static values."
        )
    return merged
