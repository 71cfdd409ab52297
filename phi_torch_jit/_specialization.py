"""Stage 5: compiled specializations, and how a call is served from them.

A :class:`Specialization` is one compiled version of a jitted function for one
input signature: the compiled program, the structure of its result, the module
guard and value guards it is valid under, and what building it cost.
:func:`run_first_valid` serves a call from the cached specializations of its
signature (newest first), or says why none could.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._context import raised_by_check
from ._custom_op import CompiledCall, original_error
from ._guards import ModuleGuard
from ._meter import Meter
from ._reads import PythonGuard
from ._reads._written_inputs import WrittenInputs
from ._signature import Spec, unflatten, unflatten_arguments
from ._state import buffer_slots, capture_rng, keep_buffer_objects, restore_rng
from ._value_guards import ValueGuard
from .errors import JitError, describe_error

__all__ = [
    "Key",
    "Timings",
    "Specialization",
    "EagerCall",
    "GuardFailure",
    "Miss",
    "run_first_valid",
    "Scanned",
    "retrace_reason",
]

Key = tuple[Spec, bool, Any]
"""(argument spec, grad mode, :func:`._ambient.ambient_state`): what a specialization is
cached under."""


logger = logging.getLogger("phi_torch_jit")

CHECK_STRIKES = 3
"""A compiled program whose library checks raise where the Python function runs (PhiML's
``Diverged`` on a solve that float rounding decides) serves again at the next call; this many
such calls in a row and it runs eagerly for good: NOTE [a check that fails on rounding]."""


@dataclass(frozen=True)
class Timings:
    """Seconds spent in each stage of one specialization."""

    record: float
    """The untraced record pass (one eager call)."""
    compile_custom: float
    """Compiling the forwards of recorded custom functions."""
    trace: float
    """Tracing the wrapper module."""


@dataclass(frozen=True)
class Specialization:
    """One compiled version of a jitted function, for one input signature."""

    key: Key
    """(argument spec, grad mode, autocast state) it was built for."""
    program: Callable[..., tuple[torch.Tensor, ...]]
    """The compiled wrapper: flat input tensors -> flat output tensors."""
    output_spec: Spec
    """Structure of the result, with static leaves as recorded."""
    modules: tuple[str, ...]
    """Names of the recorded modules (submodules of the wrapper)."""
    calls: tuple[CompiledCall, ...]
    """The distinct compiled custom calls."""
    timings: Timings
    """Time spent building it."""
    tracer_warnings: tuple[str, ...]
    """Tracer warnings raised while tracing the wrapper."""
    guard: ModuleGuard | None
    """Module state this specialization is valid for (None: it calls no modules)."""
    eager_reason: str = ""
    """Why this specialization runs the Python function instead of a compiled one, if it does."""
    value_guards: tuple[ValueGuard, ...] = ()
    """Tensor values the traced Python branched on; checked after each compiled call."""
    n_outputs: int = 0
    """Number of output tensors; the program returns the value-guard tensors after them."""
    buffers: tuple[torch.Tensor, ...] = ()
    """Buffers restored when a value guard fails (only with value guards)."""
    uses_rng: bool = True
    """Whether the RNG state must be restored when a value guard fails."""
    engine_notes: tuple[str, ...] = ()
    """What the engine reported while compiling (graphs, graph breaks, fallbacks)."""
    engine_status: Callable[[], tuple[str, ...]] | None = None
    """What the engine reports now (engine ``"auto"``: the tier serving calls)."""
    wait_engine: Callable[[float | None], bool] | None = None
    """Waits for the engine's work after the first call (a background compile)."""
    close_engine: Callable[[], None] | None = None
    """Stops the engine's pending work for it; called when it leaves the cache."""
    buffer_writes: tuple[torch.Tensor, ...] = ()
    """Buffers the function replaces by new tensors: the program returns their new values
    last, and they are copied in after the value guards passed (NOTE [side effects once])."""
    deferred: tuple[Any, ...] = ()
    """Callbacks a library deferred (PhiML's ``math.when_available``): called after each call
    with their tensors, which follow the value-guard tensors among the program's outputs."""
    eager: Callable[[list[torch.Tensor]], Any] | None = None
    """For a specialization that runs eagerly: calls the Python function on the arguments
    rebuilt from the tensors and returns its result as it is (non-tensor leaves included)."""
    python_guard: PythonGuard | None = None
    """Globals and closure variables the trace baked (checked before each call), and the
    tensors among them, which follow the arguments as inputs of the program."""
    written: WrittenInputs | None = None
    """The arguments it writes in place and how they shared memory when it was built (None:
    it writes none): NOTE [arguments written in place]."""
    served: Callable[[], None] | None = None
    """Told after each compiled call whose value guards held (engine "compile" compiles a
    value-guarded program once its path is taken again)."""
    python: Callable[[list[torch.Tensor]], Any] | None = None
    """The Python function on rebuilt arguments: what a compiled call that raised runs
    instead (NOTE [eager, never a crash])."""
    warn: Callable[[list[str]], None] | None = None
    """Warns (once per jitted function) that a specialization runs eagerly from now on."""
    failed: list[str] = field(default_factory=list)
    """Why its compiled program stopped serving (it raised where the Python function ran);
    empty while it serves."""
    check_failures: list[str] = field(default_factory=list)
    """What the library checks of the latest compiled calls raised where the Python function
    ran, one per call in a row (:data:`CHECK_STRIKES`); emptied by a call they pass."""
    meter: Meter | None = None
    """Times the first compiled calls against eager's and serves the faster path (None:
    ``jit(fallback="off")``, or an eager specialization): NOTE [never slower than eager]."""

    def run(self, tensors: list[torch.Tensor]) -> Any:
        """The result for these inputs, or a :class:`GuardFailure` (state restored) if a
        value guard fails."""
        if self.eager is not None:
            return self.eager(tensors)
        if self.failed and self.python is not None:
            return self.python(tensors)
        meter = self.meter
        if meter is not None and not meter.done:
            return meter.serve(self._run_compiled, tensors)
        return self._run_compiled(tensors)

    def _run_compiled(self, tensors: list[torch.Tensor]) -> Any:
        if self.python_guard is not None and self.python_guard.tensors:
            tensors = [*tensors, *self.python_guard.captured()]
        if not self.value_guards and self.written is None:
            return self._commit(self._execute(tensors))
        # The result may be discarded (a value guard fails) or the program may raise: what
        # it changes is saved first (``buffers`` are only kept with value guards).
        before = _Before(
            capture_rng() if self.value_guards and self.uses_rng else None,
            [b.clone() for b in self.buffers],
            self.written.save(tensors) if self.written is not None else [],
        )
        try:
            flat = self._execute(tensors)
        except BaseException as error:
            self._undo(before, tensors)
            if self.value_guards and isinstance(error, Exception):  # a value it was traced for
                return GuardFailure(  # changed (a nonzero's count): no guard was checked yet
                    f"the program raised {type(error).__name__} ({str(error)[:80]}) before its "
                    "value guards were checked"
                )
            raise
        for guard, tensor in zip(self.value_guards, flat[self.n_outputs :]):
            if not guard.holds(tensor):
                self._undo(before, tensors)
                return GuardFailure(guard.describe(tensor))
        if self.served is not None:
            self.served()
        return self._commit(flat)

    def _undo(self, before: _Before, tensors: list[torch.Tensor]) -> None:
        """Rewind the RNG, the buffers and the written arguments to ``before`` a call whose
        result is discarded."""
        if before.rng is not None:
            restore_rng(before.rng)
        with torch.no_grad():
            for buffer, value in zip(self.buffers, before.buffers):
                buffer.copy_(value)
        if self.written is not None:
            self.written.restore(tensors, before.arguments)

    def after_failure(self, error: Exception, tensors: list[torch.Tensor]) -> Any:
        """The compiled program raised ``error`` (its writes to arguments, buffers and RNG
        undone where it has value guards or writes arguments).

        NOTE [eager, never a crash]: a program whose traced Python branched on values may
        have been built for another path (a guard failure, so a retrace); one without value
        guards runs the Python function: if that raises too, the error is the user's, raised
        as eager raises it; if it runs, the program was wrong for these inputs (a size the
        trace baked), and the specialization runs eagerly from now on, warned once. Unless
        the error came from a library's check on the program's values (PhiML's ``Diverged``):
        then only :data:`CHECK_STRIKES` such calls in a row make it run eagerly for good."""
        checked = raised_by_check(error)
        if isinstance(error, JitError) or self.python is None:
            raise error
        if self.value_guards:
            return GuardFailure(f"its compiled program raised {describe_error(error)}")
        result = self.python(tensors)
        if checked:  # NOTE [a check that fails on rounding]
            self.check_failures.append(describe_error(error))
            if len(self.check_failures) < CHECK_STRIKES:
                logger.info(
                    "phi_torch_jit: a library's check on its compiled program's values raised "
                    "where the Python function runs (%s); this call returns the Python "
                    "function's result (%d of %d in a row before it runs eagerly for good)",
                    self.check_failures[-1], len(self.check_failures), CHECK_STRIKES,
                )  # fmt: skip
                return result
        reason = (
            f"its compiled program raised where the Python function runs "
            f"({describe_error(error)}); this specialization runs eagerly from now on"
        )
        self.failed.append(reason)
        if self.warn is not None:
            self.warn([reason])
        return result

    def _commit(self, flat: tuple[torch.Tensor, ...]) -> Any:
        """Write replaced buffers, run deferred callbacks, return the result."""
        if self.check_failures:
            self.check_failures.clear()
        start = self.n_outputs + len(self.value_guards)
        for deferred in self.deferred:  # usually none
            deferred.call(flat[start : start + deferred.count])
            start += deferred.count
        if self.buffer_writes:
            with torch.no_grad():
                news = flat[len(flat) - len(self.buffer_writes) :]
                for buffer, value in zip(self.buffer_writes, news):
                    buffer.copy_(value)
        return unflatten(self.output_spec, iter(flat[: self.n_outputs]))

    def _execute(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        try:
            return self.program(*tensors)
        except RuntimeError as wrapped:
            error = original_error(wrapped)
            if error is None:
                raise
            raise error.with_traceback(error.__traceback__) from None


@dataclass(frozen=True)
class _Before:
    """What a compiled call may change, saved before it runs (:meth:`Specialization._undo`)."""

    rng: Any
    """The RNG state (None: the program draws nothing, or has no value guards)."""
    buffers: list[torch.Tensor]
    """Copies of the specialization's buffers (value guards only)."""
    arguments: list[torch.Tensor]
    """Copies of the arguments it writes (:attr:`Specialization.written`)."""


@dataclass(frozen=True)
class GuardFailure:
    """A value guard did not hold; the compiled result was discarded."""

    description: str
    """What changed, e.g. ``bool(...) at step.py:12: True -> False``."""


@dataclass(frozen=True)
class Miss:
    """No cached specialization could serve a call."""

    failure: GuardFailure | None
    """The first value-guard failure, if that is why."""


@dataclass(frozen=True)
class Scanned(Miss):
    """Served, but only after the programs of other specializations ran and failed their value
    guards (``failure`` is the first): NOTE [values that never repeat]."""

    result: Any = None
    """The call's result."""


def run_first_valid(entries: Sequence[Specialization], tensors: list[torch.Tensor]) -> Any:
    """Run the newest specialization whose guards hold; a :class:`Miss` if none does."""
    failure = None
    for specialization in entries:
        guard = specialization.guard
        if guard is not None and not guard.holds():
            continue
        python = specialization.python_guard
        if python is not None and not python.holds():
            continue
        written = specialization.written
        if written is not None and not written.same_sharing(tensors):
            continue
        try:
            result = specialization.run(tensors)
        except (RuntimeError, AssertionError) as error:  # inductor asserts input sizes
            if guard is not None and guard.moved():  # module.double(), .to(), .data =: retrace
                continue
            if specialization.eager is not None or specialization.failed:
                raise  # the Python function itself raised
            result = specialization.after_failure(error, tensors)
        if not isinstance(result, GuardFailure):
            return result if failure is None else Scanned(failure, result)
        failure = failure or result
    return Miss(failure)


def retrace_reason(entries: Sequence[Specialization], miss: Any) -> str | None:
    """Why the cached specializations did not serve (None: a new argument signature)."""
    if isinstance(miss, Miss) and miss.failure is not None:
        return f"value guard failed: {miss.failure.description}"
    if not entries:
        return None
    python = entries[0].python_guard
    if python is not None and not python.holds():
        return python.describe_change()
    if entries[0].guard is not None:
        return entries[0].guard.describe_change()
    return None


class EagerCall:
    """Runs a specialization eagerly: the user function on the rebuilt arguments. With
    ``modules`` (the meter's eager samples, a compiled program's fallback), buffers forward
    replaces are left as compiled calls leave them (``_state.keep_buffer_objects``)."""

    def __init__(self, fn: Callable[..., Any], arg_spec: Spec,
                 modules: Sequence[nn.Module] = ()) -> None:  # fmt: skip
        self.fn = fn
        self.arg_spec = arg_spec
        self.modules = tuple(modules) if buffer_slots(modules) else ()  # none: nothing to keep

    def __call__(self, tensors: list[torch.Tensor]) -> Any:
        args, kwargs = unflatten_arguments(self.arg_spec, tensors)
        if not self.modules:
            return self.fn(*args, **kwargs)
        slots = buffer_slots(self.modules)
        try:
            return self.fn(*args, **kwargs)
        finally:
            keep_buffer_objects(slots)
