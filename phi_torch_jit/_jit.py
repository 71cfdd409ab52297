"""The ``jit`` decorator: signature -> cache hit, or the stages in order.

A call builds its cache key (stage 0, :mod:`._signature`) and is served by a cached
:class:`._specialization.Specialization` (:mod:`._cache`). On a miss,
:meth:`JitFunction._specialize` runs the stages in order -- the numbering of docs/design.md:

1. :func:`._record.record` -- the untraced run; its result is returned;
2. :func:`._custom_op.compile_calls` -- compile each custom call's forward into an op;
3. :func:`._wrapper.make_wrapper` -- a module holding the recorded modules' tensors;
4. :func:`._trace.trace` -- the engine traces the wrapper while the recording replays;
5. a :class:`._specialization.Specialization` with its :class:`._guards.ModuleGuard` joins
   the cache under the key (next to specializations of other module states or branches).
"""

from __future__ import annotations

import functools
import time
import types
import weakref
from collections.abc import Callable
from typing import Any, Generic, ParamSpec, TypeVar, overload

import torch
from torch import nn

from ._cache import SpecializationCache
from ._compat import get_tracing_state
from ._context import current_frame
from ._custom_op import CompiledCall, compile_calls
from ._explain import Reporter, explain_specialization
from ._guards import ModuleGuard, has_backward_hooks
from ._options import DISABLE_ENV, ENGINE_ENV, Options, positional_names
from ._record import Recording, check_modules, record
from ._signature import describe_spec, flatten_arguments, flatten_outputs, modules_in
from ._specialization import GuardFailure, Key, Miss, Specialization, Timings, retrace_reason
from ._specialization import run_first_valid as serve
from ._state import rng_restored
from ._trace import Traced, trace, wrapper_engine
from ._wrapper import WrapperModule, make_wrapper, module_names
from .engines import CompiledModule, Engine
from .engines.compile import Backend
from .errors import GuardError, RunEagerly, TraceError, describe_function

__all__ = ["jit", "JitFunction", "Specialization", "DISABLE_ENV", "ENGINE_ENV", "clear_caches"]

P = ParamSpec("P")
R = TypeVar("R")


class JitFunction(Generic[P, R]):
    """A function compiled per input signature; see :func:`jit`."""

    def __init__(
        self,
        fn: Callable[P, R],
        *,
        engine: str | Engine | None = None,
        max_traces: int = 8,
        guard_hooks: bool = True,
        on_guard_failure: str = "retrace",
        **engine_options: Any,
    ) -> None:
        options = Options.of(fn, engine, max_traces, guard_hooks, on_guard_failure, engine_options)
        self._options = options
        self._engine = options.engine
        self._fn = fn
        self._owner = describe_function(fn)
        self._arg_names = positional_names(fn)
        self._cache = SpecializationCache(max_traces)
        self._report = Reporter(self._owner, self._arg_names, max_traces)
        _LIVE.add(self)
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
        return self._report.num_traces

    @property
    def specializations(self) -> tuple[Specialization, ...]:
        """The compiled specializations, newest first per signature (for introspection)."""
        return tuple(self._cache)

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        """``@jit`` on a method: bind ``self`` like a function would (it becomes an argument)."""
        return self if instance is None else types.MethodType(self, instance)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._engine.passthrough or current_frame() is not None or get_tracing_state():
            return self._fn(*args, **kwargs)  # eager, or inlined into an enclosing trace
        spec, tensors = flatten_arguments(args, kwargs, self._owner, self._arg_names)
        key = (spec, torch.is_grad_enabled())
        seen = self._cache.lookup(key)
        result = serve(seen, tensors) if seen else Miss(None)
        if not isinstance(result, Miss):
            self._cache.touch(key)
            return result  # type: ignore[no-any-return]
        if result.failure is not None and self._options.on_guard_failure != "retrace":
            return self._guard_failed(result.failure, args, kwargs)  # type: ignore[no-any-return]
        return self._miss(key, seen, result, args, kwargs, tensors)  # type: ignore[no-any-return]

    def _miss(
        self, key: Key, seen: tuple[Specialization, ...], miss: Miss, args: Any, kwargs: Any,
        tensors: list[torch.Tensor],
    ) -> Any:  # fmt: skip
        """Build a specialization under the cache lock, unless another thread just did."""
        with self._cache.lock:
            fresh = [s for s in self._cache.lookup(key) if all(s is not old for old in seen)]
            result = serve(fresh, tensors) if fresh else Miss(None)
            if not isinstance(result, Miss):
                return result
            reason = retrace_reason(list(seen), miss if seen else None)
            value, specialization = self._specialize(key, args, kwargs, tensors)
            for dropped in self._cache.insert(specialization):
                self._report.evicted(dropped)
            self._report.traced(key, reason)
            return value

    def _specialize(
        self, key: Key, args: Any, kwargs: Any, tensors: list[torch.Tensor]
    ) -> tuple[Any, Specialization]:
        """The stages for a cache miss; return (the eager result, the specialization)."""
        start = time.perf_counter()
        result, recording = record(self._fn, args, kwargs, self._owner, modules_in(key[0]))
        output_spec, outputs = flatten_outputs(result, self._owner)
        record_s = time.perf_counter() - start
        check_modules(recording, self._owner)
        modules = recording.root_modules()
        wrapper = make_wrapper(self._fn, key[0], modules, self._owner)
        eager_reason, traced, compile_s = self._eager_reason(recording), None, 0.0
        if not eager_reason:
            try:
                traced, calls, compile_s = self._compile(recording, wrapper, tensors)
            except RunEagerly as signal:
                eager_reason = self._report.runs_eagerly(signal.reason)
        if traced is None:  # custom functions run eagerly inside the wrapper's forward
            traced, calls = Traced(CompiledModule(wrapper.forward), (), output_spec, 0.0), ()
        elif traced.output_spec != output_spec:
            raise TraceError(
                f"phi_torch_jit: {self._owner} returned a different structure while tracing "
                f"({describe_spec(traced.output_spec)}) than while recording "
                f"({describe_spec(output_spec)}). Make the output structure depend only on the "
                "inputs' shapes and static values."
            )
        if not eager_reason:
            self._report.side_effects(recording.side_effects)
        return result, Specialization(
            key=key,
            program=traced.module.run,
            output_spec=output_spec,
            modules=tuple(module_names(modules)),
            calls=calls,
            timings=Timings(record_s, compile_s, traced.seconds),
            tracer_warnings=self._report.tracer_warnings(traced.module),
            guard=ModuleGuard(modules, self._options.guard_hooks) if modules else None,
            eager_reason=eager_reason,
            value_guards=traced.value_guards,
            n_outputs=len(outputs),
            buffers=tuple(b for m in modules for b in m.buffers()) if traced.value_guards else (),
            uses_rng=traced.module.uses_rng,
            engine_notes=traced.module.notes,
        )

    def _compile(
        self, recording: Recording, wrapper: WrapperModule, tensors: list[torch.Tensor]
    ) -> tuple[Traced, tuple[CompiledCall, ...], float]:
        """Stages 2 and 4: (what the trace produced, the distinct compiled calls, stage 2's s)."""
        engine, note = wrapper_engine(self._engine, recording)
        start = time.perf_counter()
        with rng_restored():
            steps = compile_calls(recording.calls, self._engine, engine.captures_graph)
        compile_s = time.perf_counter() - start
        guarding = self._options.on_guard_failure != "off"
        traced = trace(engine, steps, recording, wrapper, tensors, guarding, note)
        calls = tuple({id(s.compiled): s.compiled for s in steps}.values())
        return traced, calls, compile_s

    def _eager_reason(self, recording: Recording) -> str:
        """Why a specialization must run eagerly (empty if it can be compiled)."""
        reasons = list(recording.eager_reasons)
        if has_backward_hooks(recording.modules.values()):
            reasons.append(
                "a module it calls has backward hooks, which a compiled program cannot fire"
            )
        return self._report.runs_eagerly("; ".join(reasons)) if reasons else ""

    def _guard_failed(self, failure: GuardFailure, args: Any, kwargs: Any) -> Any:
        """A value guard failed and the policy is not "retrace": run eagerly or raise."""
        if self._options.on_guard_failure == "eager":
            return self._fn(*args, **kwargs)
        raise GuardError(
            f"phi_torch_jit: {self._owner} branched on a tensor value that changed since it was "
            f"traced: {failure.description}. The compiled program would return the traced "
            "branch's result. Use jit(on_guard_failure='retrace') (the default) or 'eager', or "
            "replace the Python branch by tensor operations (torch.where)."
        )

    def clear_cache(self) -> None:
        """Drop every compiled specialization (and the tensors and ops they hold)."""
        self._cache.clear()

    def explain(self) -> str:
        """A readable report: per specialization, signature, modules, custom functions, times."""
        lines = [
            f"{self._owner}: engine {self._engine.name!r}, {self.num_traces} trace(s), "
            f"max_traces={self._options.max_traces}"
        ]
        if self._engine.passthrough:
            lines.append("  runs eagerly: nothing is recorded or compiled")
        for i, spec in enumerate(self.specializations):
            lines += explain_specialization(i, spec)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<jitted {self._owner}, engine={self._engine.name!r}>"


_LIVE: weakref.WeakSet[JitFunction[..., Any]] = weakref.WeakSet()


def clear_caches() -> None:
    """Drop the compiled specializations of every jitted function (frees their memory)."""
    for function in list(_LIVE):
        function.clear_cache()


@overload
def jit(
    fn: Callable[P, R],
    *,
    engine: str | Engine | None = ...,
    max_traces: int = ...,
    guard_hooks: bool = ...,
    on_guard_failure: str = ...,
    backend: Backend | None = ...,
    **compile_options: Any,
) -> JitFunction[P, R]: ...


@overload
def jit(
    fn: None = None,
    *,
    engine: str | Engine | None = ...,
    max_traces: int = ...,
    guard_hooks: bool = ...,
    on_guard_failure: str = ...,
    backend: Backend | None = ...,
    **compile_options: Any,
) -> Callable[[Callable[P, R]], JitFunction[P, R]]: ...


def jit(
    fn: Callable[P, R] | None = None,
    *,
    engine: str | Engine | None = None,
    max_traces: int = 8,
    guard_hooks: bool = True,
    on_guard_failure: str = "retrace",
    backend: Backend | None = None,
    **compile_options: Any,
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
    * Values: tensor-to-Python conversions in ``fn`` become guards, checked
      after each compiled call (a few microseconds each; none if there are none).
    * Module state: each module the function calls is guarded: a changed
      training flag (``train()``/``eval()``), hooks added, removed or replaced,
      or parameters/buffers replaced by new objects retrace (and the previous
      specialization stays cached). A function whose modules have backward
      hooks runs eagerly (logged once), so the hooks fire as in eager mode.

    Args:
        fn: a function, an nn.Module, or a method (``@jit`` on ``forward``).
            May be omitted to use ``jit(...)`` as a decorator factory.
        engine: ``"torchscript"`` (default; fastest first call), ``"compile"``
            (``torch.compile`` of the captured graph: slower first call, fused
            steady state; see docs/engines.md), ``"eager"`` (no compilation, for
            debugging), or an :class:`~phi_torch_jit.engines.Engine`. Left out:
            the environment variable ``PHI_TORCH_JIT_ENGINE`` (``"compile"``,
            ``"compile:aot_eager"``...) or ``"torchscript"``. The environment
            variable ``PHI_TORCH_JIT_DISABLE=1`` forces ``"eager"``.
        max_traces: number of specializations before a warning (>= 1).
        guard_hooks: check hooks and parameter/buffer identity of the modules
            before each call (about 0.3 us per module); with False only
            training flags are checked and hooks changed after compiling are
            ignored, like torch.compile's ``skip_nnmodule_hook_guards``.
        on_guard_failure: what a compiled call does when a tensor value that the
            traced Python branched on (``if x.sum() > 0``, ``int(t)``,
            ``t.item()``) differs from the traced one: ``"retrace"`` (default;
            compile the new branch too), ``"eager"`` (run the Python), ``"error"``
            (raise :class:`~phi_torch_jit.GuardError`), or ``"off"`` (no guards:
            the traced branch is silently reused -- torch's TracerWarning is shown).
        backend: with ``engine="compile"``: the torch.compile backend, a name
            (``"inductor"``, the default; any of ``torch._dynamo.list_backends()``
            or registered ones) or a callable ``(gm, example_inputs) -> callable``.
        **compile_options: with ``engine="compile"``: ``mode``, ``options``,
            ``fullgraph``, ``dynamic`` for torch.compile.

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
    options: dict[str, Any] = {
        "engine": engine,
        "max_traces": max_traces,
        "guard_hooks": guard_hooks,
        "on_guard_failure": on_guard_failure,
        "backend": backend,
        **compile_options,
    }
    if fn is None:
        return functools.partial(jit, **options)  # type: ignore[return-value]
    return JitFunction(fn, **options)
