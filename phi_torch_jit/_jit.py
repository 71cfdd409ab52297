"""The ``jit`` decorator: signature -> cache hit, or the stages in order.

A call builds its cache key (stage 0, :mod:`._signature`) and is served by a cached
:class:`._specialization.Specialization`. On a miss, under the cache lock and after checking
what other threads added meanwhile (:mod:`._cache`), :func:`._pipeline.specialize` runs
stages 1-5 in order and the result joins the cache.
"""

from __future__ import annotations

import functools
import time
import types
from collections.abc import Callable
from typing import Any, Generic, ParamSpec, TypeVar, overload

import torch
from torch import nn

from ._ambient import ambient_state
from ._cache import SpecializationCache, clear_caches
from ._compat import functorch_transform, get_tracing_state
from ._context import current_frame
from ._explain import Reporter, explain
from ._meter import MISSES, WINDOW, HitRate
from ._options import (
    DISABLE_ENV,
    ENGINE_ENV,
    Options,
    copy_names,
    keywords_in_order,
    positional_names,
)
from ._path_meter import PathMeters
from ._pipeline import VALUE_SPECIALIZATIONS, Target, eager_run, eager_specialization, specialize
from ._signature import flatten_arguments
from ._specialization import Key, Miss, Scanned, Specialization, retrace_reason
from ._specialization import run_first_valid as serve
from .engines import Engine, wait_all_compiled
from .engines.compile import Backend
from .errors import WalkFailed, describe_function

__all__ = [
    "jit",
    "JitFunction",
    "Specialization",
    "DISABLE_ENV",
    "ENGINE_ENV",
    "clear_caches",
    "wait_compiled",
]

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
        label: str | None = None,
        side_effects: str = "eager",
        fallback: str = "measure",
        **engine_options: Any,
    ) -> None:
        options = Options.of(
            fn, engine, max_traces, guard_hooks, on_guard_failure, engine_options, side_effects,
            fallback,
        )  # fmt: skip
        self._options = options
        self._engine = options.engine
        self._fn = fn
        self._owner = label or describe_function(fn)
        """How messages and logs name the function, e.g. ``step (sim.py:12)``; ``label``
        overrides it (``phiflow.install()`` names the user's function, not PhiML's wrapper)."""
        self._arg_names = positional_names(fn)
        self._in_order = keywords_in_order(fn)
        self._cache = SpecializationCache(max_traces)
        self._report = Reporter(self._owner, self._arg_names, max_traces)
        self._target = Target(fn, self._owner, options, self._report)
        self._hit_rate = HitRate()
        self._value_misses: dict[Key, int] = {}
        """Value-guard misses per signature, also those whose call kept no specialization
        (engine "auto" compiling in the background): NOTE [values that never repeat]."""
        self._paths = (
            PathMeters(functools.partial(eager_run, self._target), self._report.paths_switched)
            if options.fallback == "measure"
            else None
        )
        """Measures what a signature with several value-guarded paths costs against eager."""
        self._gave_up = False
        """The calls keep missing the cache: every call runs the Python function (NOTE
        [never slower than eager]); kept by ``clear_cache()``."""
        self._eager_streak = 0
        """Consecutive calls served by eager specializations (:meth:`_served_eagerly`)."""
        if isinstance(fn, nn.Module):
            self.__doc__ = type(fn).__doc__
        else:
            copy_names(self, fn)
        self.__text_signature__ = "(*args, **kwargs)"
        """What ``inspect.signature(jitted, follow_wrapped=False)`` reads: having ``__get__``
        (for methods), this object looks like a method descriptor to ``inspect``, which then
        wants a text signature (PhiML's ``functional_gradient`` asks for it, like for any
        ``functools.wraps`` wrapper). Followed, ``__wrapped__`` gives ``fn``'s own."""

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
        self._hit_rate.calls += 1
        if (
            self._gave_up
            or self._engine.passthrough
            or current_frame() is not None
            or get_tracing_state()
            or functorch_transform() is not None
        ):  # eager; inlined into an enclosing trace; or inside vmap/grad, which see the Python
            return self._fn(*args, **kwargs)
        spec, tensors = flatten_arguments(
            args, kwargs, self._owner, self._arg_names, self._in_order
        )
        key = (spec, torch.is_grad_enabled(), ambient_state())
        seen = self._cache.lookup(key)
        if len(seen) > 1 and self._paths is not None:  # several paths: measured
            result = self._paths.serve(key, seen, tensors)
        else:
            result = serve(seen, tensors) if seen else Miss(None)
        if not isinstance(result, Miss):
            self._cache.touch(seen[0].key)  # the stored key: found by identity, not compared
            if seen[0].eager is not None:
                self._served_eagerly()
            else:
                self._eager_streak = 0
            return result  # type: ignore[no-any-return]
        self._eager_streak = 0
        if type(result) is Scanned:  # served after other paths' programs ran
            self._cache.touch(seen[0].key)
            return result.result  # type: ignore[no-any-return]
        policy = self._options.on_guard_failure
        if result.failure is not None and policy == "eager":
            return self._fn(*args, **kwargs)  # the traced branch no longer holds: run Python
        if result.failure is not None and policy == "error":
            raise self._report.guard_error(result.failure.description)
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
            if type(result) is Scanned:
                return result.result
            never = self._values_never_repeat(key, seen, miss)
            session = None if never else self._engine.tracing_session(self._target.owner)
            if session is None:  # eager; or engine "auto" compiles: without the record pass
                return self._fn(*args, **kwargs)
            reason = retrace_reason(list(seen), miss if seen else None)
            self._target.unread.note_failed(seen)  # counters: watched in the record pass
            with session:
                try:
                    value, specialization = specialize(self._target, key, args, kwargs, tensors)
                except WalkFailed as failed:
                    if not failed.before_record:  # (after it: _pipeline returns its result)
                        raise
                    self._report.cannot_compile([failed.reason])
                    specialization = eager_specialization(self._target, key, failed.reason)
                    value = self._fn(*args, **kwargs)
            if specialization is None:  # engine "auto" is compiling: this call ran eagerly
                return value
            for dropped in self._cache.insert(specialization):
                self._report.evicted(dropped)
            self._report.traced(key, reason)
            if self._options.fallback == "measure" and self._hit_rate.missed():
                self._gave_up = True
                self._report.gave_up(MISSES, WINDOW)
            return value

    def _served_eagerly(self) -> None:
        """A call was served by an eager specialization. Once ``WINDOW`` calls in a row were
        and every cached specialization is eager, the function runs its Python directly: the
        signature lookup cost 2-4% of a 0.3 ms step that only runs eagerly (NOTE [values
        that never repeat])."""
        self._eager_streak += 1
        if self._eager_streak < WINDOW or self._options.fallback != "measure":
            return
        specializations = self.specializations
        if specializations and all(s.eager is not None for s in specializations):
            self._gave_up = True
            self._report.all_eager(len(specializations), WINDOW)
        self._eager_streak = 0

    def _values_never_repeat(self, key: Key, seen: tuple[Specialization, ...], miss: Miss) -> bool:
        """Whether a signature's tensor values changed its path too often to compile each
        (NOTE [values that never repeat]); then one eager specialization replaces its others.
        Misses are counted also when no specialization was kept (engine "auto" busy)."""
        if miss.failure is None:
            return False
        misses = self._value_misses[key] = self._value_misses.get(key, 0) + 1
        if len(seen) < VALUE_SPECIALIZATIONS and misses <= VALUE_SPECIALIZATIONS:
            return False
        why = (
            "tensor values its Python branches on changed the path on each of "
            f"{max(len(seen) + 1, misses)} calls with this signature (last: "
            f"{miss.failure.description}); compiling each would cost more than it saves"
        )
        self._cache.replace(eager_specialization(self._target, key, why))
        if self._paths is not None:
            self._paths.forget(key)
        self._report.cannot_compile([why], stacklevel=5)
        return True

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait until the background compiles of this function's specializations have finished
        (engine ``"auto"``; other engines compile before the first call returns).

        Returns True when every specialization runs on its final tier (compiled, or the fast
        tier after a failed compile), False if ``timeout`` seconds passed first. Calls made
        meanwhile from other threads are served as usual.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for specialization in self.specializations:
            wait = specialization.wait_engine
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if wait is not None and not wait(left):
                return False
        return True

    def clear_cache(self) -> None:
        """Drop every compiled specialization (and the tensors and ops they hold)."""
        self._cache.clear()
        if self._paths is not None:
            self._paths.clear()

    def trace_check(self, *args: P.args, **kwargs: P.kwargs) -> tuple[bool, str]:
        """Whether a call with these arguments would find a specialization compiled for its
        signature: ``(True, "")``, or ``(False, why not)`` (``"not yet traced"``, or what
        differs from the newest one). Runs nothing; the values guards check at a call are not
        compared (like PhiML's ``math.trace_check``)."""
        spec, _ = flatten_arguments(args, kwargs, self._owner, self._arg_names, self._in_order)
        key = (spec, torch.is_grad_enabled(), ambient_state())
        if self._cache.lookup(key):
            return True, ""
        known = self.specializations
        if not known:
            return False, "not yet traced"
        return False, self._report.change(known[0].key, key)

    def explain(self) -> str:
        """A readable report: per specialization, signature, modules, custom functions, times."""
        paths = self._paths.describe() if self._paths is not None else []
        return explain(self._report, self._engine, self.specializations, self._gave_up, paths)

    def __repr__(self) -> str:
        return f"<jitted {self._owner}, engine={self._engine.name!r}>"


@overload
def jit(
    fn: Callable[P, R],
    *,
    engine: str | Engine | None = ...,
    max_traces: int = ...,
    guard_hooks: bool = ...,
    on_guard_failure: str = ...,
    side_effects: str = ...,
    fallback: str = ...,
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
    side_effects: str = ...,
    fallback: str = ...,
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
    side_effects: str = "eager",
    fallback: str = "measure",
    backend: Backend | None = None,
    **compile_options: Any,
) -> JitFunction[P, R] | Callable[[Callable[P, R]], JitFunction[P, R]]:
    """Compile ``fn`` once per input signature; later calls run the compiled program.

    Contract: tensor arguments are traced; every other argument is static. Tensors are keyed by
    shape, dtype, device and requires_grad; static values (int, float, bool, str, None, enums,
    tuples of these, hashable objects) by value, nn.Modules by identity, and the grad mode is
    part of the key. A new key retraces; ``num_traces`` counts traces, and past ``max_traces`` a
    :class:`~phi_torch_jit.JitWarning` names what changed.

    What runs when:

    * First call of a signature: ``fn`` runs once eagerly (its result is returned, with the side
      effects of one eager call), custom functions' forwards are compiled, and ``fn`` is traced
      once more with RNG and module buffers rewound, custom functions returning their recorded
      outputs instead of running.
    * Later calls: only the compiled program. No Python of ``fn``, of the modules it calls or of
      custom forwards runs (unless a custom function had to fall back to Python, which is
      logged). Parameters and buffers of the modules ``fn`` calls are live: ``optimizer.step()``
      is seen.
    * Nested (or inside ``torch.func`` transforms): the Python runs, inlined into the outer trace.
    * Guards (docs/guarded.md): tensor values turned into Python, globals and closure variables,
      module state (training flags, hooks, parameter objects, plain attributes, submodules) and
      autocast; a change retraces, older specializations stay cached. What cannot be compiled
      faithfully (backward hooks, random draws, tensor hooks...) runs eagerly, said once.

    Args:
        fn: a function, an nn.Module, or a method (``@jit`` on ``forward``). May be omitted to
            use ``jit(...)`` as a decorator factory.
        engine: ``"auto"`` (default; runs no TorchScript: the captured graph runs at once on a
            straight-line fast tier while inductor compiles it on a background thread, then
            switches; :meth:`JitFunction.wait_compiled` waits for that; custom-function bodies
            are captured graphs, their data-dependent loops compiled blocks, docs/loops.md),
            ``"compile"`` (the backend's compile of the captured graph in the first call:
            slower first call, no tier switch; ``loops=False`` keeps loops as TorchScript or
            Python; see docs/engines.md), ``"torchscript"`` (legacy: ``torch.jit.trace``,
            which PyTorch deprecated; fastest first call), ``"eager"`` (no compilation, for
            debugging), or an :class:`~phi_torch_jit.engines.Engine`. Left out: the
            environment variable ``PHI_TORCH_JIT_ENGINE`` (``"compile"``,
            ``"compile:aot_eager"``...) or ``"auto"``. ``PHI_TORCH_JIT_DISABLE=1`` forces
            ``"eager"``.
        max_traces: number of specializations before a warning (>= 1).
        guard_hooks: check hooks and parameter/buffer identity of the modules before each call
            (about 0.3 us per module); with False only training flags are checked and hooks
            changed after compiling are ignored, like torch.compile's
            ``skip_nnmodule_hook_guards``.
        on_guard_failure: what a compiled call does when a tensor value that the traced Python
            branched on (``if x.sum() > 0``, ``int(t)``, ``t.item()``) differs from the traced
            one: ``"retrace"`` (default; compile the new branch too), ``"eager"`` (run the
            Python), ``"error"`` (raise :class:`~phi_torch_jit.GuardError`), or ``"off"`` (no
            guards: the traced branch is silently reused -- torch's TracerWarning is shown).
        side_effects: what a specialization does whose run changes Python state the function
            reads (a counter, an appended list, ``self.n += 1``): ``"eager"`` (default; it runs
            eagerly, with one JitWarning naming the state, so results and side effects equal
            eager's) or ``"trace"`` (JAX's rule: compiled; the Python side effects happen in
            the record and trace passes of each new specialization only, guards read the state
            as the trace left it).
        fallback: ``"measure"`` (default): a specialization whose compiled step is more than
            10% slower than eager's runs eagerly after its first calls (one in five of them
            timed eagerly), measured again after 64 eager calls and then less and less often;
            a function whose calls keep missing the cache (new shapes or branches on most
            calls) stops compiling, with one JitWarning; each switch is logged once and shown
            by ``explain()``. ``"off"``: always the compiled program. (``engine="eager"``
            forces eager code.)
        backend: with ``engine="compile"`` or ``"auto"``: the torch.compile backend, a name
            (``"inductor"``, the default; any of ``torch._dynamo.list_backends()`` or registered
            ones) or a callable ``(gm, example_inputs) -> callable``.
        **compile_options: with ``engine="compile"``: ``mode``, ``options``, ``fullgraph``,
            ``dynamic`` for torch.compile. With ``engine="auto"``: ``mode``, ``options``,
            ``disable`` and ``compile_on`` (``"background"``, the default, or ``"caller"``:
            the backend compiles inside the second call of each specialization,
            deterministically).

    Returns:
        A :class:`JitFunction` with ``fn``'s signature.

    Raises:
        UsageError: ``fn`` is not callable, or an option the engine does not take (TypeError).
        ConfigurationError: an option value that is not accepted; lists those that are.
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
        "side_effects": side_effects,
        "fallback": fallback,
        "backend": backend,
        **compile_options,
    }
    if fn is None:
        return functools.partial(jit, **options)  # type: ignore[return-value]
    return JitFunction(fn, **options)


def wait_compiled(timeout: float | None = None) -> bool:
    """Wait until every background compile of this process is done: engine ``"auto"``'s, of
    every jitted function, those made by ``phi_torch_jit.phiflow.install()`` included.

    Returns True when none is queued or running, False if ``timeout`` seconds passed first
    (``UsageError`` for a negative timeout, or one that is no number: a jitted function
    passed waits with its own ``wait_compiled()``). Other engines compile on the caller's thread:
    nothing to wait for. While one function's compile runs inductor's Python, another
    function's first calls cannot be captured and run eagerly; they are captured while it
    waits for its C++ compiler (docs/engines.md, "Several jitted functions"): wait here
    before timing, or before a run whose first steps matter. Inside a jitted function's
    first call (its record pass), False at once: that compile waits for the call to end.
    """
    return wait_all_compiled(timeout)
