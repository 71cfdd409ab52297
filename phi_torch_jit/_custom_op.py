"""Stage 2: compile each recorded custom call into an opaque torch op.

Each distinct recorded call (same custom function, static arguments and
input shapes) becomes a :class:`CompiledCall`:

* its forward is compiled right away by the engine on the recorded inputs;
* its backward is a :class:`~._backward.LazyBackward`;
* both are registered as an operator ``phi_torch_jit::<name>_<n>`` in a
  private ``torch.library.Library`` with an autograd formula. The wrapper's
  trace records one node for the call, whatever runs inside; the forward
  runs once per compiled call and the backward only when autograd asks.

During the trace pass the op returns the recorded outputs instead of
computing them (see :meth:`CompiledCall.replay`): nothing runs twice.
See NOTE [custom calls as ops] in docs/design.md.

Custom functions called *inside* a forward or backward that is being
compiled (typically the adjoint solve in a gradient) become nested compiled
calls through :class:`NestedCalls`, so the outer trace stays faithful.
See NOTE [nested custom functions].
"""

from __future__ import annotations

import hashlib
import re
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._backward import LazyBackward
from ._compat import (
    destroy_library,
    disable_dispatch_modes,
    get_tracing_state,
    kept_though_unused,
    unaliased,
)
from ._context import CustomCallee, Replaying, call_state, no_frame
from ._custom import TENSOR, CustomFunction, merge_tensors, split_tensors, untraced
from ._graph_safety import backward_tags, forward_tags
from ._libraries import ForwardChecks, forward_checks, owned_by_library
from ._own_backward import own_backward
from ._phases import compiling
from ._record import RecordedCall
from .engines import Engine, FunctionTarget
from .engines._op_contracts import OpContract, TensorMeta, known
from .errors import TraceError

__all__ = ["CompiledCall", "NestedCalls", "ReplayStep", "compile_calls", "original_error"]

_STEMS: dict[str, int] = {}
"""How many ops of this process were named from each stem (:func:`_op_name`)."""


def _op_name(function: str, kept: bool, contract: Any) -> str:
    """A custom call's op name: the function's name, whether the op is kept though unused
    (inductor's on-disk cache keys a graph by its text, and a program compiled where a
    same-named op could be dropped must not serve), and a hash of its contract (inputs,
    outputs' metadata, tags), numbered only after the first of a stem in a process. A counter
    over the process named a PhiFlow simulation's solve after the ones jitted before it, so
    its graph's text, and inductor's keys, depended on what ran earlier in the process: no
    warm start for the second simulation of a script run in another order (NOTE [warm
    starts])."""
    base = re.sub(r"\W", "_", function).strip("_") or "custom"
    digest = hashlib.sha256(repr(contract).encode()).hexdigest()[:8]
    stem = f"{base}{'_kept' if kept else ''}_{digest}"
    count = _STEMS[stem] = _STEMS.get(stem, 0) + 1
    return stem if count == 1 else f"{stem}_{count - 1}"


class _FlatForward:
    """``f`` as a flat function: tensor inputs in, tuple of tensor outputs out."""

    def __init__(
        self,
        function: CustomFunction,
        template: tuple[Any, ...],
        source: Any = None,
        defer: bool = False,
    ) -> None:
        self.function = function
        self.template = template
        self.source = source
        """Runs in place of the function's ``loop_source`` (its loops captured)."""
        self.defer = defer
        """Run as Python, a library's deferred checks still become outputs, as when traced: a
        library's solve run around its captured loop in place of its traced forward."""
        self.checks = ForwardChecks()
        """Checks libraries deferred in the latest traced run (a solve's convergence check);
        their tensors follow the outputs (none when values were available: the checks ran)."""

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args = merge_tensors(self.template, tensors)
        tracing = get_tracing_state() is not None
        if not tracing and not self.defer:  # run as Python (every call): checks see real values
            return self.function.run_forward(args, self.source)[0]
        # traced once, by the compile; or run as Python with the traced form's outputs
        with forward_checks(always=not tracing) as collecting:
            outputs = self.function.run_forward(args, None if tracing else self.source)[0]
        checks = collecting.checks
        if checks:
            self.checks = checks
        return (*outputs, *checks.tensors)


def original_error(wrapped: BaseException) -> BaseException | None:
    """The exception a custom forward raised inside a compiled program, if ``wrapped`` is how
    the program reported it (TorchScript turns it into a RuntimeError); taken only once."""
    state = call_state()
    error, state.last_error = state.last_error, None
    return error if error is not None and str(error) in str(wrapped) else None


def _weak(method: Callable[..., Any]) -> Callable[..., Any]:
    """A function calling ``method`` without keeping its object alive."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call(*args: Any, **kwargs: Any) -> Any:  # torch passes setup_context's ctx by name
        bound = ref()
        if bound is None:
            raise RuntimeError(
                "phi_torch_jit: a compiled program outlived its custom op; this is a bug, "
                "please report it. Calling phi_torch_jit.clear_caches() recovers."
            )
        return bound(*args, **kwargs)

    return call


class CompiledCall:
    """A custom function compiled for one recorded call signature, exposed as an op."""

    def __init__(self, recorded: RecordedCall, engine: Engine, graph_captured: bool) -> None:
        function = recorded.function
        tensors, template = split_tensors(recorded.args)
        self.function = function
        self.template = template
        self.single = recorded.single
        self.n_inputs = len(tensors)
        self.n_outputs = len(recorded.outputs)
        all_tensors = self.n_inputs == len(template)
        self.nested = NestedCalls(engine)
        flat = _FlatForward(function, template)
        looped: list[_FlatForward] = []
        defer = owned_by_library(function.loop_source)  # its looped form defers its checks too

        def with_loop_source(source: Any) -> _FlatForward:
            looped.append(_FlatForward(function, template, source, defer))
            return looped[-1]

        target = FunctionTarget(
            flat,
            tuple(tensors),
            f"forward of {function.label}",
            scriptable=function.scriptable if all_tensors else None,
            expected=recorded.outputs,
            loop_source=function.loop_source,
            with_loop_source=with_loop_source,
        )
        with compiling(function.label, self.nested):
            self.forward = engine.compile_function(target)
        if self.forward.mode == "traced":
            self.checks = (self.forward.origin or flat).checks
        elif self.forward.mode == "looped" and defer:
            self.checks = looped[-1].checks
        else:
            self.checks = ForwardChecks()
        """Deferred checks the compiled forward returns the values of (NOTE [PhiML bridge])."""
        self.n_info = len(self.checks.tensors)
        """Outputs of the op after the function's own: the values the checks need (and a
        library's records of the call, NOTE [SolveTape under jit])."""
        self.info_recorded = tuple(t.detach().clone() for t in self.checks.tensors)
        """Those values for the recorded inputs (the compile ran the forward on them)."""
        # A compiled forward runs no Python, so its context is the one of the compile run.
        self.static_context = call_state().last_context if not self.forward.runs_python else None
        if self.forward.mode == "python":
            function.note_python_fallback("forward", self.forward.reason)
        self.backward = LazyBackward(function, template, self.n_outputs, engine, self.nested)
        self.recorded_context = recorded.context
        self.graph_captured = graph_captured
        """Whether the wrapper's engine captures a graph (``Engine.captures_graph``): its
        backward op then serves every call with the recorded call context (NOTE [opaque
        backward])."""
        self.output_meta = tuple(TensorMeta.of(o) for o in (*recorded.outputs, *self.info_recorded))
        self._fake_present: dict[tuple[bool, ...], tuple[bool, ...]] = {}
        self._library = torch.library.Library("phi_torch_jit", "FRAGMENT")
        self.op_name = self._define_op()

    def _define_op(self) -> str:
        kept = self.forward.runs_python or bool(self.checks)
        tags = forward_tags(self.forward.mode, bool(self.checks))
        name = _op_name(self.function.__name__, kept, (self.n_inputs, self.output_meta, tags))
        self.contract = OpContract(
            name,
            self.n_inputs,
            self.n_outputs,
            self.output_meta,
            tuple(tag.name for tag in tags),
            tuple(tag.name for tag in backward_tags()),
            kept,
        )
        # torch's registry is C++ and would keep strong references alive forever: register
        # weak ones, and remove the op when this object is collected (NOTE [custom calls as ops]).
        self.op, self.backward_op = self.contract.define(
            self._library,
            impl=_weak(self._impl),
            backward=_weak(self._backward),
            setup_context=_weak(self._setup_context),
            backward_impl=_weak(self._backward_impl),
        )
        weakref.finalize(self, destroy_library(self._library))
        weakref.finalize(self, known(self.contract, _weak(self._present)))
        if kept:  # its Python or its checks run eagerly whether its outputs are used or not
            weakref.finalize(self, kept_though_unused(self.op))
        if not self.n_info:  # a gradient inside the step runs its backward as traced ops
            undo = own_backward(self.op, _weak(self._python_vjp), self.function.label)
            weakref.finalize(self, undo)
        return name

    def _python_vjp(self, inputs: Any, outputs: Any, grad_outputs: Any) -> tuple[Any, ...]:
        """The user's backward as Python on (traced) tensors, for ``torch.autograd.grad``
        inside the step (NOTE [autograd inside the step])."""
        args = merge_tensors(self.template, list(inputs))
        needs = tuple(slot is TENSOR for slot in self.template)
        grads = self.function.gradients(args, outputs, grad_outputs, needs, self._backward_context)
        return tuple(g for g, slot in zip(grads, self.template) if slot is TENSOR)

    @property
    def _backward_context(self) -> Any:
        """The call context of a backward serving every call (NOTE [opaque backward])."""
        return self.recorded_context if self.forward.runs_python else self.static_context

    def replay(self, recorded: RecordedCall, args: Sequence[Any]) -> Any:
        """The trace pass's call: record the op in the trace, return the recorded outputs."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if self.n_inputs == 0:  # nothing to trace through: the outputs are constants
            outputs = recorded.outputs
        else:
            state = call_state()
            previous = state.replaying
            recorded_outputs = (*recorded.outputs, *(t.clone() for t in self.info_recorded))
            state.replaying = Replaying(self, recorded_outputs, recorded.context)
            try:
                result = self.op(*tensors)
            finally:
                state.replaying = previous
            outputs = result if isinstance(result, tuple) else (result,)
            if self.n_info:  # libraries note the call around its traced values
                self.checks.traced(outputs[self.n_outputs :])
                outputs = outputs[: self.n_outputs]
        return outputs[0] if self.single else tuple(outputs)

    def _impl(self, *tensors: torch.Tensor) -> Any:
        state = call_state()
        replaying = state.replaying
        if replaying is not None and replaying.call is self:
            outputs, state.pending_context = replaying.outputs, replaying.context
        else:
            try:
                results = self.forward.run(*tensors)
            except BaseException as error:  # re-raised unchanged by Specialization.run
                state.last_error = error
                raise
            if self.checks:  # raises as eager code does (PhiML's NotConverged, Diverged)
                try:
                    self.checks.run(results[self.n_outputs :])
                except BaseException as error:
                    state.last_error = state.check_error = error
                    raise
            python = self.forward.runs_python
            state.pending_context = state.last_context if python else self.static_context
            if python and self.graph_captured and state.pending_context != self.recorded_context:
                raise TraceError(
                    f"phi_torch_jit: {self.function.label} runs as Python and left other values "
                    "on its ctx than in the call that was compiled; the backward of a "
                    "torch.compile graph cannot receive per-call ctx values. Use "
                    "engine='torchscript' for this function, or keep ctx contents independent "
                    "of tensor values."
                )
            outputs = tuple(unaliased(results, tensors))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _setup_context(self, ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        self.contract.save(ctx, inputs, output)
        state = call_state()
        ctx.call_context, state.pending_context = state.pending_context, None

    def _backward(self, ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        traced = self.contract.traced_backward(self.backward_op, ctx, grad_outputs, self._present)
        if traced is not None:  # NOTE [opaque backward]
            return traced
        saved = ctx.saved_tensors
        grad_outputs = grad_outputs[: self.n_outputs]  # the solve's values get no gradient
        pattern = tuple(bool(n) for n in ctx.needs_input_grad)
        inputs, outputs = saved[: self.n_inputs], saved[self.n_inputs :]
        return self.backward(pattern, inputs, outputs, grad_outputs, ctx.call_context)

    def _present(
        self,
        pattern: tuple[bool, ...],
        saved: Sequence[TensorMeta],
        grad_outputs: Sequence[TensorMeta],
    ) -> tuple[bool, ...]:
        """Which inputs get a gradient (not None) for ``pattern``, learnt by running the
        user's gradient once, as Python, on real zeros shaped like the traced tensors, with
        the call context the backward op serves every call with: a graph must know at capture
        time which gradients are None (NOTE [opaque backward]). Asked by a capture here, or
        by one in the compile worker (``engines._op_contracts``)."""
        answer = self._fake_present.get(pattern)
        if answer is None:
            with disable_dispatch_modes(), no_frame(), torch.no_grad():
                real = [torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in saved]
                ones = [torch.ones(g.shape, dtype=g.dtype, device=g.device) for g in grad_outputs]
                inputs = merge_tensors(self.template, real[: self.n_inputs])
                outputs = tuple(real[self.n_inputs :])
                full = iter(pattern)
                needs = tuple(next(full) if s is TENSOR else False for s in self.template)
                grads = self.function.gradients(
                    inputs, outputs, tuple(ones), needs, self._backward_context
                )
            tensor_grads = [g for g, slot in zip(grads, self.template) if slot is TENSOR]
            answer = tuple(need and g is not None for g, need in zip(tensor_grads, pattern))
            self._fake_present[pattern] = answer
        return answer

    def _backward_impl(
        self, saved: list[torch.Tensor], grad_outputs: list[torch.Tensor], pattern: list[bool]
    ) -> list[torch.Tensor]:
        inputs, outputs = saved[: self.n_inputs], saved[self.n_inputs :]
        grads = self.backward(tuple(pattern), inputs, outputs, grad_outputs, self._backward_context)
        kept = unaliased(grads, (*saved, *grad_outputs))
        return [torch.zeros_like(x) if g is None else g for g, x in zip(kept, inputs)]

    def __repr__(self) -> str:
        return f"<compiled call phi_torch_jit::{self.op_name} of {self.function.label}>"


class NestedCalls:
    """Custom functions called inside a forward or backward being compiled.

    Each such call runs once eagerly with tracing hidden (for its values),
    is compiled like a recorded call, and is then replayed into the enclosing
    trace as its op. Identical call signatures share one compiled call. This
    object keeps those calls (and their ops) alive as long as its owner.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.calls: dict[Hashable, CompiledCall] = {}

    def call(self, function: CustomCallee, args: tuple[Any, ...]) -> tuple[Any, Any]:
        """(outputs, call context) of a custom function called by a body being compiled."""
        assert isinstance(function, CustomFunction), "frames hand on custom functions only"
        # hidden from the enclosing capture: a TorchScript trace, or make_fx's dispatch modes
        with untraced(), disable_dispatch_modes(), no_frame(), torch.no_grad():
            outputs, single = function.run_forward(args)
            context = call_state().last_context
            recorded = RecordedCall.of(function, args, outputs[0] if single else outputs, context)
            key = _dedup_key(recorded)
            if key not in self.calls:
                self.calls[key] = CompiledCall(recorded, self.engine, graph_captured=False)
        return self.calls[key].replay(recorded, args), context


def _dedup_key(recorded: RecordedCall) -> Hashable:
    tensors, template = split_tensors(recorded.args)
    metas = tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)
    statics = tuple(v for v in template if v is not TENSOR)
    try:
        hash(statics)
    except TypeError:
        return id(recorded)
    return (recorded.function, statics, metas, len(template), recorded.single)


@dataclass(frozen=True)
class ReplayStep:
    """One recorded custom call and the compiled call that replays it (handed out in order by
    the trace's :class:`._replay.ReplayCursor`)."""

    recorded: RecordedCall
    """What the record pass saw."""
    compiled: CompiledCall
    """The op that stands for it in the trace."""


def compile_calls(
    calls: Sequence[RecordedCall], engine: Engine, graph_captured: bool
) -> list[ReplayStep]:
    """Stage 2: compile every recorded custom call; identical call signatures share one op.

    ``graph_captured``: whether the engine that traces the wrapper captures a graph
    (``Engine.captures_graph``), which changes how the backward op serves call contexts.
    """
    compiled: dict[Hashable, CompiledCall] = {}
    steps = []
    for recorded in calls:
        key = _dedup_key(recorded)
        if key not in compiled:
            compiled[key] = CompiledCall(recorded, engine, graph_captured)
        steps.append(ReplayStep(recorded, compiled[key]))
    return steps
