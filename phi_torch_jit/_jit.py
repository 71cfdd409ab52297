"""The ``jit`` decorator: signature -> cache hit, or the stages in order.

A call builds its argument spec (:mod:`._signature`); a cached
:class:`Specialization` runs the compiled program. On a miss the stages run
in order:

1. :func:`._record.record` -- the untraced run; its result is returned;
2. :func:`._custom_op.compile_calls` -- compile each custom call's forward;
3. :func:`._wrapper.make_wrapper` -- a module holding the recorded modules;
4. the engine traces the wrapper while a :class:`._replay.ReplayCursor`
   replays the custom calls, with RNG and buffers rewound (:mod:`._state`);
5. a :class:`._guards.ModuleGuard` snapshots the module state the trace baked
   in; the result is cached under the spec (plus the grad mode), next to other
   specializations of the same spec that differ in module state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import threading
import time
import types
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, ParamSpec, TypeVar, overload

import torch
from torch import nn

from ._compat import get_tracing_state
from ._context import current_frame, tracing_frame
from ._custom_op import compile_calls
from ._explain import explain_specialization
from ._guards import ModuleGuard, has_backward_hooks
from ._record import Recording, RunEagerly, record
from ._replay import ReplayCursor
from ._signature import (
    describe_spec,
    first_difference,
    flatten_arguments,
    flatten_outputs,
    modules_in,
)
from ._specialization import (
    Build,
    GuardFailure,
    Key,
    Miss,
    Specialization,
    Timings,
    retrace_reason,
    run_first_valid,
)
from ._state import capture_rng, restore_rng
from ._value_guards import GUARD_POLICIES, Conversion, ValueGuard, conversion_capture
from ._warnings import describe_warning, reemit
from ._wrapper import WrapperModule, make_wrapper, module_names
from .engines import CompiledModule, Engine, get_engine
from .engines.compile import Backend
from .errors import GuardError, JitWarning, TraceError, describe_function

__all__ = ["jit", "JitFunction", "Specialization", "DISABLE_ENV", "ENGINE_ENV", "clear_caches"]

P = ParamSpec("P")
R = TypeVar("R")

logger = logging.getLogger("phi_torch_jit")

DISABLE_ENV = "PHI_TORCH_JIT_DISABLE"
"""Set to ``1`` to make every jitted function created afterwards use engine ``eager``."""

ENGINE_ENV = "PHI_TORCH_JIT_ENGINE"
"""The engine of jitted functions created without ``engine=``: a name, or ``compile:<backend>``."""


def _default_engine(options: dict[str, Any]) -> str:
    """The engine named by ``PHI_TORCH_JIT_ENGINE`` (``torchscript`` if unset)."""
    name, _, backend = os.environ.get(ENGINE_ENV, "").partition(":")
    if backend and "backend" not in options:
        options["backend"] = backend
    return name or "torchscript"


def _positional_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    target = fn.forward if isinstance(fn, nn.Module) else fn
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


def _reject_data_parallel(modules: Any, owner: str) -> None:
    """DDP/DataParallel do per-call Python work a compiled program would skip: refuse them.

    See docs/distributed.md: the supported pattern jits the step *inside* the module that
    DistributedDataParallel wraps, so DDP's own forward runs around the compiled call.
    """
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    for module in modules:
        if isinstance(module, wrappers):
            raise TraceError(
                f"phi_torch_jit: {owner} calls a {type(module).__name__} module. Its forward "
                "does per-call work (gradient-reduction bookkeeping, buffer broadcasts) that a "
                "compiled program would skip, so gradients would silently not be averaged. Jit "
                "the step inside the module instead and wrap that module: "
                "DistributedDataParallel(Trainer(net)) where Trainer.forward calls the jitted "
                "step (see docs/distributed.md)."
            )


def _trace_input(t: torch.Tensor) -> torch.Tensor:
    """A copy of an input for the trace pass, so in-place edits do not reach the caller's tensor."""
    return t.detach().clone().requires_grad_(t.requires_grad)


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
        if not callable(fn):
            raise TypeError(f"phi_torch_jit: jit needs a callable, got {type(fn).__name__}.")
        if not isinstance(max_traces, int) or max_traces < 1:
            raise ValueError(f"phi_torch_jit: max_traces must be an int >= 1, got {max_traces!r}.")
        if on_guard_failure not in GUARD_POLICIES:
            raise ValueError(
                f"phi_torch_jit: on_guard_failure must be one of {GUARD_POLICIES}, "
                f"got {on_guard_failure!r}."
            )
        engine_options = {k: v for k, v in engine_options.items() if v is not None}
        if engine is None:
            engine = _default_engine(engine_options)
        self._engine = get_engine(engine, engine_options)
        if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
            self._engine = get_engine("eager")
        self._fn = fn
        self._owner = describe_function(fn)
        self._arg_names = _positional_names(fn)
        self._max_traces = max_traces
        self._guard_hooks = guard_hooks
        self._on_guard_failure = on_guard_failure
        self._cache: OrderedDict[Key, list[Specialization]] = OrderedDict()  # LRU order
        self._lock = threading.RLock()
        self._num_traces = 0
        self._last_key: Key | None = None
        self._warned = False
        self._eager_logged = False
        self._side_effects_warned = False
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
        return self._num_traces

    @property
    def specializations(self) -> tuple[Specialization, ...]:
        """The compiled specializations, newest first per signature (for introspection)."""
        return tuple(s for entries in self._cache.values() for s in entries)

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        """``@jit`` on a method: bind ``self`` like a function would (it becomes an argument)."""
        return self if instance is None else types.MethodType(self, instance)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if (
            self._engine.passthrough
            or current_frame() is not None
            or get_tracing_state() is not None
        ):
            return self._fn(*args, **kwargs)  # eager, or inlined into an enclosing trace
        spec, tensors = flatten_arguments(args, kwargs, self._owner, self._arg_names)
        key = (spec, torch.is_grad_enabled())
        entries = self._cache.get(key, [])
        seen = len(entries)
        if seen:
            result = run_first_valid(entries, tensors)
            if not isinstance(result, Miss):
                if len(self._cache) > 1:
                    self._cache.move_to_end(key)
                return result  # type: ignore[no-any-return]
            if result.failure is not None and self._on_guard_failure != "retrace":
                return self._guard_failed(result.failure, args, kwargs)  # type: ignore[no-any-return]
        with self._lock:
            entries = self._cache.setdefault(key, [])
            if len(entries) > seen:  # another thread compiled meanwhile: try what it added
                result = run_first_valid(entries[: len(entries) - seen], tensors)
                if not isinstance(result, Miss):
                    return result  # type: ignore[no-any-return]
            reason = retrace_reason(entries, result if seen else None)
            value, specialization = self._specialize(key, args, kwargs, tensors)
            entries.insert(0, specialization)
            self._cache.move_to_end(key)
            self._note_trace(key, reason)
            self._evict()
            return value  # type: ignore[no-any-return]

    def _evict(self) -> None:
        """Keep at most ``max_traces`` specializations: drop the least recently used ones."""
        while sum(map(len, self._cache.values())) > self._max_traces:
            key, entries = next(iter(self._cache.items()))
            dropped = entries.pop()  # the oldest of the least recently used signature
            if not entries:
                del self._cache[key]
            logger.info(
                "phi_torch_jit: dropped the least recently used specialization of %s: %s",
                self._owner,
                describe_spec(dropped.key[0]),
            )

    def clear_cache(self) -> None:
        """Drop every compiled specialization (and the tensors and ops they hold)."""
        with self._lock:
            self._cache.clear()

    def _guard_failed(self, failure: GuardFailure, args: Any, kwargs: Any) -> Any:
        """A value guard failed and the policy is not "retrace": run eagerly or raise."""
        if self._on_guard_failure == "eager":
            return self._fn(*args, **kwargs)
        raise GuardError(
            f"phi_torch_jit: {self._owner} branched on a tensor value that changed since it was "
            f"traced: {failure.description}. The compiled program would return the traced "
            "branch's result. Use jit(on_guard_failure='retrace') (the default) or 'eager', or "
            "replace the Python branch by tensor operations (torch.where)."
        )

    def _specialize(
        self, key: Key, args: Any, kwargs: Any, tensors: list[torch.Tensor]
    ) -> tuple[Any, Specialization]:
        """Run the stages for a cache miss; return (the eager result, the specialization)."""
        start = time.perf_counter()
        result, recording = record(self._fn, args, kwargs, self._owner, modules_in(key[0]))
        output_spec, outputs = flatten_outputs(result, self._owner)
        record_s = time.perf_counter() - start
        _reject_data_parallel(recording.modules.values(), self._owner)
        modules = recording.root_modules()
        guard = ModuleGuard(modules, self._guard_hooks) if modules else None
        wrapper = make_wrapper(self._fn, key[0], modules, self._owner)
        eager_reason = self._eager_reason(recording)
        build = None
        if not eager_reason:
            try:
                build = self._compile(recording, wrapper, tensors)
            except RunEagerly as signal:
                eager_reason = self._log_eager(signal.reason)
        if build is None:  # custom functions run eagerly inside the wrapper's forward
            build = Build([], CompiledModule(wrapper.forward), (), 0.0, 0.0)
        elif wrapper.output_spec != output_spec:
            raise TraceError(
                f"phi_torch_jit: {self._owner} returned a different structure while tracing "
                f"({describe_spec(wrapper.output_spec or ('S', None, None))}) than while "
                f"recording ({describe_spec(output_spec)}). Make the output structure depend "
                "only on the inputs' shapes and static values."
            )
        if recording.side_effects and not eager_reason:
            self._warn_side_effects(recording.side_effects)
        guarded_state = tuple(b for m in modules for b in m.buffers()) if build.value_guards else ()
        specialization = Specialization(
            key=key,
            program=build.module.run,
            output_spec=output_spec,
            modules=tuple(module_names(modules)),
            calls=tuple({id(s.compiled): s.compiled for s in build.steps}.values()),
            timings=Timings(record_s, build.compile_custom_s, build.trace_s),
            tracer_warnings=self._show_tracer_warnings(build),
            guard=guard,
            eager_reason=eager_reason,
            value_guards=build.value_guards,
            n_outputs=len(outputs),
            buffers=guarded_state,
            uses_rng=build.module.uses_rng,
            engine_notes=build.module.notes,
        )
        return result, specialization

    def _compile(
        self, recording: Recording, wrapper: WrapperModule, tensors: list[torch.Tensor]
    ) -> Build:
        """Stages 2-4: compile custom calls, then trace the wrapper replaying them."""
        start = time.perf_counter()
        rng = capture_rng()
        try:
            steps = compile_calls(recording.calls, self._engine)
        finally:
            restore_rng(rng)
        compiled_custom = time.perf_counter()
        cursor = ReplayCursor(steps, self._owner)
        example = tuple(_trace_input(t) for t in tensors)
        guarding = self._on_guard_failure != "off"
        conversions: list[Conversion] | None = [] if guarding else None
        capture = conversion_capture() if guarding else contextlib.nullcontext()
        with (
            capture,
            recording.state.rewound(),
            tracing_frame(self._owner, cursor, conversions),
            recording.phiml.active(),
        ):
            engine = self._engine
            if recording.phiml.used and not engine.torchscript_tracing:
                engine = get_engine("torchscript")  # PhiML's custom gradients need its tracer
            compiled = engine.compile_module(wrapper, example, self._owner)
            if engine is not self._engine:
                note = f"engine {self._engine.name!r} used 'torchscript': PhiML custom gradients"
                compiled = dataclasses.replace(compiled, notes=(*compiled.notes, note))
        cursor.finish()
        value_guards = tuple(ValueGuard(c.kind, c.value, c.location) for c in conversions or ())
        return Build(
            steps,
            compiled,
            value_guards,
            compiled_custom - start,
            time.perf_counter() - compiled_custom,
        )

    def _warn_side_effects(self, seen: list[str]) -> None:
        """Warn once per jitted function about Python side effects compiled calls skip."""
        if self._side_effects_warned:
            return
        self._side_effects_warned = True
        warnings.warn(
            JitWarning(
                f"phi_torch_jit: {self._owner} has Python side effects ({', '.join(seen)}) that "
                "ran while it was compiled but will not run on compiled calls, which execute no "
                "Python. Move them outside the jitted function, return the values instead, or "
                "use engine='eager' while debugging."
            ),
            stacklevel=5,
        )

    def _show_tracer_warnings(self, build: Build) -> tuple[str, ...]:
        """Pass the tracer warnings on to the user; return their descriptions for explain()."""
        reemit(build.module.tracer_warnings)
        return tuple(describe_warning(w) for w in build.module.tracer_warnings)

    def _eager_reason(self, recording: Recording) -> str:
        """Why a specialization must run eagerly (empty if it can be compiled)."""
        reasons = list(recording.eager_reasons)
        if has_backward_hooks(recording.modules.values()):
            reasons.append(
                "a module it calls has backward hooks, which a compiled program cannot fire"
            )
        return self._log_eager("; ".join(reasons)) if reasons else ""

    def _log_eager(self, reason: str) -> str:
        """Log (once per jitted function) that a specialization runs eagerly; return the reason."""
        if not self._eager_logged:
            self._eager_logged = True
            logger.warning("phi_torch_jit: %s runs eagerly: %s", self._owner, reason)
        return reason

    def _note_trace(self, key: Key, reason: str | None) -> None:
        self._num_traces += 1
        if reason is None:
            reason = (
                "first call"
                if self._last_key is None
                else self._describe_change(self._last_key, key)
            )
        self._last_key = key
        logger.info("phi_torch_jit: traced %s (#%d): %s", self._owner, self._num_traces, reason)
        if self._num_traces > self._max_traces and not self._warned:
            self._warned = True  # and _evict drops the least recently used specialization
            warnings.warn(
                JitWarning(
                    f"phi_torch_jit: {self._owner} has been traced {self._num_traces} times "
                    f"(max_traces={self._max_traces}); the last retrace was caused by {reason}. "
                    "The least recently used specializations are dropped from now on. Pass "
                    "values that change from call to call as tensors, or raise max_traces."
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
