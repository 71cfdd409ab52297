"""The ``jit`` decorator: signature -> cache hit, or the stages in order.

A call builds its argument spec (:mod:`._signature`); a cached
:class:`Specialization` runs the compiled program. On a miss the stages run
in order:

1. :func:`._record.record` -- the untraced run; its result is returned;
2. :func:`._custom_op.compile_calls` -- compile each custom call's forward;
3. :func:`._wrapper.make_wrapper` -- a module holding the recorded modules;
4. the engine traces the wrapper while a :class:`._replay.ReplayCursor`
   replays the custom calls, with RNG and buffers rewound (:mod:`._state`);
5. the result is cached under the spec (plus the grad mode).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
import time
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, ParamSpec, TypeVar, overload

import torch
from torch import nn

from ._context import current_frame, tracing_frame
from ._custom_op import CompiledCall, compile_calls
from ._record import record
from ._replay import ReplayCursor
from ._signature import (
    Spec,
    describe_spec,
    first_difference,
    flatten_arguments,
    flatten_outputs,
    modules_in,
    unflatten,
)
from ._state import capture_rng, restore_rng
from ._wrapper import make_wrapper
from .engines import Engine, get_engine
from .errors import JitWarning, TraceError, describe_function

__all__ = ["jit", "JitFunction", "Specialization", "DISABLE_ENV"]

P = ParamSpec("P")
R = TypeVar("R")

logger = logging.getLogger("phi_torch_jit")

DISABLE_ENV = "PHI_TORCH_JIT_DISABLE"
"""Set to ``1`` to make every jitted function created afterwards use engine ``eager``."""

Key = tuple[Spec, bool]


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
    """(argument spec, grad mode) it was built for."""
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

    def __call__(self, tensors: list[torch.Tensor]) -> Any:
        return unflatten(self.output_spec, iter(self.program(*tensors)))


def _positional_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    target = fn.forward if isinstance(fn, nn.Module) else fn
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


def _trace_input(t: torch.Tensor) -> torch.Tensor:
    """A copy of an input for the trace pass, so in-place edits do not reach the caller's tensor."""
    return t.detach().clone().requires_grad_(t.requires_grad)


class JitFunction(Generic[P, R]):
    """A function compiled per input signature; see :func:`jit`."""

    def __init__(
        self, fn: Callable[P, R], *, engine: str | Engine = "torchscript", max_traces: int = 8
    ) -> None:
        if not callable(fn):
            raise TypeError(f"phi_torch_jit: jit needs a callable, got {type(fn).__name__}.")
        if not isinstance(max_traces, int) or max_traces < 1:
            raise ValueError(f"phi_torch_jit: max_traces must be an int >= 1, got {max_traces!r}.")
        if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
            engine = "eager"
        self._fn = fn
        self._engine = get_engine(engine)
        self._owner = describe_function(fn)
        self._arg_names = _positional_names(fn)
        self._max_traces = max_traces
        self._cache: dict[Key, Specialization] = {}
        self._lock = threading.RLock()
        self._num_traces = 0
        self._last_key: Key | None = None
        self._warned = False
        if isinstance(fn, nn.Module):
            self.__doc__ = type(fn).__doc__
        else:
            functools.update_wrapper(self, fn)

    @property
    def engine(self) -> Engine:
        """The engine that compiles this function."""
        return self._engine

    @property
    def num_traces(self) -> int:
        """How many specializations have been compiled so far."""
        return self._num_traces

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        """``@jit`` on a method: bind ``self`` like a function would (it becomes an argument)."""
        return self if instance is None else types.MethodType(self, instance)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if (
            self._engine.passthrough
            or current_frame() is not None
            or torch._C._get_tracing_state() is not None
        ):
            return self._fn(*args, **kwargs)  # eager, or inlined into an enclosing trace
        spec, tensors = flatten_arguments(args, kwargs, self._owner, self._arg_names)
        key = (spec, torch.is_grad_enabled())
        hit = self._cache.get(key)
        if hit is not None:
            return hit(tensors)  # type: ignore[no-any-return]
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                return hit(tensors)  # type: ignore[no-any-return]
            result, specialization = self._specialize(key, args, kwargs, tensors)
            self._cache[key] = specialization
            self._note_trace(key)
            return result  # type: ignore[no-any-return]

    def _specialize(
        self, key: Key, args: Any, kwargs: Any, tensors: list[torch.Tensor]
    ) -> tuple[Any, Specialization]:
        """Run the stages for a cache miss; return (the eager result, the specialization)."""
        start = time.perf_counter()
        result, recording = record(self._fn, args, kwargs, self._owner, modules_in(key[0]))
        output_spec, _ = flatten_outputs(result, self._owner)
        recorded = time.perf_counter()
        rng = capture_rng()
        try:
            steps = compile_calls(recording.calls, self._engine)
        finally:
            restore_rng(rng)
        compiled_custom = time.perf_counter()
        modules = recording.root_modules()
        wrapper = make_wrapper(self._fn, key[0], modules, self._owner)
        cursor = ReplayCursor(steps, self._owner)
        example = tuple(_trace_input(t) for t in tensors)
        with recording.state.rewound(), tracing_frame(self._owner, cursor):
            compiled = self._engine.compile_module(wrapper, example, self._owner)
        cursor.finish()
        if wrapper.output_spec != output_spec:
            raise TraceError(
                f"phi_torch_jit: {self._owner} returned a different structure while tracing "
                f"({describe_spec(wrapper.output_spec or ('S', None, None))}) than while "
                f"recording ({describe_spec(output_spec)}). Make the output structure depend "
                "only on the inputs' shapes and static values."
            )
        traced = time.perf_counter()
        unique = tuple({id(s.compiled): s.compiled for s in steps}.values())
        specialization = Specialization(
            key=key,
            program=compiled.run,
            output_spec=output_spec,
            modules=tuple(name for name, _ in wrapper.named_children()),
            calls=unique,
            timings=Timings(recorded - start, compiled_custom - recorded, traced - compiled_custom),
            tracer_warnings=compiled.warnings,
        )
        return result, specialization

    def _note_trace(self, key: Key) -> None:
        self._num_traces += 1
        reason = (
            "first call" if self._last_key is None else self._describe_change(self._last_key, key)
        )
        self._last_key = key
        logger.info("phi_torch_jit: traced %s (#%d): %s", self._owner, self._num_traces, reason)
        if self._num_traces > self._max_traces and not self._warned:
            self._warned = True
            warnings.warn(
                JitWarning(
                    f"phi_torch_jit: {self._owner} has been traced {self._num_traces} times "
                    f"(max_traces={self._max_traces}); the last retrace was caused by {reason}. "
                    "Pass values that change from call to call as tensors, or raise max_traces."
                ),
                stacklevel=4,
            )

    def _describe_change(self, old: Key, new: Key) -> str:
        if old[0] == new[0]:
            states = {True: "enabled", False: "disabled"}
            return f"grad mode {states[old[1]]} -> {states[new[1]]}"
        return first_difference(old[0], new[0], self._arg_names)

    def explain(self) -> str:
        """A readable report: per specialization, signature, modules, custom functions, times."""
        lines = [
            f"{self._owner}: engine {self._engine.name!r}, {self._num_traces} trace(s), "
            f"max_traces={self._max_traces}"
        ]
        if self._engine.passthrough:
            lines.append("  runs eagerly: nothing is recorded or compiled")
        for i, spec in enumerate(self._cache.values()):
            lines += _explain_specialization(i, spec)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<jitted {self._owner}, engine={self._engine.name!r}>"


def _explain_specialization(index: int, spec: Specialization) -> list[str]:
    grad = "grad enabled" if spec.key[1] else "grad disabled"
    t = spec.timings
    lines = [
        f"[{index}] {describe_spec(spec.key[0])}, {grad}",
        f"    modules: {', '.join(spec.modules) or 'none'}",
        f"    times: record {t.record * 1e3:.1f} ms, compile custom functions "
        f"{t.compile_custom * 1e3:.1f} ms, trace {t.trace * 1e3:.1f} ms",
    ]
    if not spec.calls:
        lines.append("    custom functions: none")
    for call in spec.calls:
        forward = call.forward.mode + (f" ({call.forward.reason})" if call.forward.reason else "")
        lines.append(f"    custom function {call.function.label} as op {call.op_name}:")
        lines.append(f"      forward: {forward}")
        backwards = call.backward.specializations
        if not backwards:
            lines.append("      backward: not compiled yet (compiled at the first backward)")
        for pattern, b in backwards.items():
            reason = (
                f" ({b.compiled.reason})" if b.compiled is not None and b.compiled.reason else ""
            )
            lines.append(f"      backward for needs_input_grad={pattern}: {b.mode}{reason}")
    lines += [f"    tracer warning: {w}" for w in spec.tracer_warnings]
    return lines


@overload
def jit(
    fn: Callable[P, R], *, engine: str | Engine = ..., max_traces: int = ...
) -> JitFunction[P, R]: ...


@overload
def jit(
    fn: None = None, *, engine: str | Engine = ..., max_traces: int = ...
) -> Callable[[Callable[P, R]], JitFunction[P, R]]: ...


def jit(
    fn: Callable[P, R] | None = None,
    *,
    engine: str | Engine = "torchscript",
    max_traces: int = 8,
) -> JitFunction[P, R] | Callable[[Callable[P, R]], JitFunction[P, R]]:
    """Compile ``fn`` once per input signature; later calls run the compiled program.

    Contract: tensor arguments are traced; every other argument is static.
    Tensors are keyed by shape, dtype, device and requires_grad; static values
    (int, float, bool, str, None, enums, tuples of these, hashable objects) by
    value, nn.Modules by identity, and the grad mode is part of the key. A new
    key retraces; ``num_traces`` counts traces, and past ``max_traces`` a
    :class:`~phi_torch_jit.JitWarning` names what changed.

    What runs when:

    * First call of a signature: ``fn`` runs once eagerly (its result is
      returned, with the side effects of one eager call), custom functions'
      forwards are compiled, and ``fn`` is traced once more with RNG and
      module buffers rewound, custom functions returning their recorded
      outputs instead of running.
    * Later calls: only the compiled program. No Python of ``fn``, of the
      modules it calls or of custom forwards runs (unless a custom function
      had to fall back to Python, which is logged). Parameters and buffers of
      the modules ``fn`` calls are live: ``optimizer.step()`` is seen.
    * Nested: a jitted function called while another is being traced is
      inlined into the outer trace.

    Args:
        fn: a function, an nn.Module, or a method (``@jit`` on ``forward``).
            May be omitted to use ``jit(...)`` as a decorator factory.
        engine: ``"torchscript"`` (default), ``"eager"`` (no compilation, for
            debugging), or an :class:`~phi_torch_jit.engines.Engine`. The
            environment variable ``PHI_TORCH_JIT_DISABLE=1`` forces ``"eager"``.
        max_traces: number of specializations before a warning (>= 1).

    Returns:
        A :class:`JitFunction` with ``fn``'s signature.

    Raises:
        SignatureError: an argument can be neither traced nor keyed.
        OutputError: a result leaf cannot be returned from a compiled program.
        ReplayError: custom functions ran differently while tracing.
        TraceError: the engine rejected the function (message says why).

    Example:
        >>> import torch, phi_torch_jit as ptj
        >>> @ptj.jit
        ... def step(u, dt: float = 0.1):
        ...     return u + dt * (torch.roll(u, 1) - 2 * u + torch.roll(u, -1))
        >>> u = step(torch.zeros(8))
        >>> step.num_traces
        1
    """
    if fn is None:
        return functools.partial(jit, engine=engine, max_traces=max_traces)  # type: ignore[return-value]
    return JitFunction(fn, engine=engine, max_traces=max_traces)
