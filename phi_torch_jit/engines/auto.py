"""Engine ``"auto"``: the captured program runs at once, and switches to inductor when ready.

The first call of a signature does what engine ``"compile"`` does up to the capture (record
pass, custom functions' forwards compiled, the wrapper captured once with ``make_fx``), then
serves the captured graph through a *fast tier* that costs no backend compile:
``straight-line`` (the graph as generated Python calling each op's C function: eager speed),
or with ``torchscript=True`` ``torchscript-graph`` (a TorchScript trace of the captured graph,
faithful: no user Python is in it) where TorchScript works and the graph only calls ops.

Meanwhile the backend (inductor) compiles the same graph on a background thread (``_background``;
cold inductor compiles in a worker process, then loaded, ``_compile_process``; served calls
leave them a core, ``_spare_core``), on the graph directly: no dynamo, no run of the program,
the backward with the forward. One assignment then switches to it: a call runs wholly on one
tier. A failed compile is logged once and the fast tier stays (``explain()``).

Both tiers run the same graph: results agree to float rounding (about 1e-6 relative in
float32, docs/engines.md); random ops draw as eager code does on both (``fallback_random``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._compat import any_autocast
from .._state import capture_rng, restore_rng
from ..errors import ConfigurationError, JitError, NotNow, describe_error
from ._background import awaited, exiting, wait_idle
from ._background import submit as submit_compile
from ._block_tiers import BackgroundBlock, submit_pending
from ._capture import CAPTURE_LOCK as _CAPTURE_LOCK
from ._capture import capture as _capture
from ._capture import uses_rng as _uses_rng
from ._compile_process import ahead_of, compile_ahead, start_worker_for
from ._generic_sizes import sizes_left_dynamic
from ._light import straight_line, tensor_ops_only
from ._spare_core import HELD, with_fewer_threads
from ._state_meta import Fixed, fixed_of, same_placement
from ._tracing_lock import note_busy
from ._warm_starts import await_loads, remembered
from .base import CompiledModule, Engine
from .compile import UNROLLED, Backend, Compilable, CompileEngine
from .torchscript import trace_graph

__all__ = ["AutoEngine", "TieredProgram", "COMPILE_ON"]

COMPILE_ON = ("background", "caller")
"""Where engine "auto" runs the backend's compile (``AutoEngine(compile_on=...)``)."""

logger = logging.getLogger("phi_torch_jit")


class AutoEngine(CompileEngine):
    """Engine ``"compile"``'s captured graph, served by a fast tier until the backend's
    compile, running on a background thread, is ready.

    Args:
        backend: as for :class:`~phi_torch_jit.engines.compile.CompileEngine` (default
            ``"inductor"``); called directly on the captured graph.
        functions: the engine that compiles the bodies of custom functions (default: captured
            graphs run straight-line, :mod:`._graph_bodies`; TorchScript with
            ``torchscript=True``).
        compile_on: ``"background"`` (default): the compile runs on the background thread
            and the caller never waits for it. ``"caller"``: it runs on the caller's thread,
            inside the second call of each specialization, so the switch comes at a known
            call (deterministic; for tests and for debugging a backend).
        torchscript: use TorchScript where it works (default False: this engine, the default
            one, runs no TorchScript): custom-function bodies traced by it, and the fast tier
            a TorchScript trace of the captured graph instead of straight-line Python.
        **options: ``mode`` and ``options`` (inductor settings). ``fullgraph``, ``dynamic``
            and ``disable`` concern dynamo, which this engine does not use; ``disable=True``
            keeps every specialization on the fast tier.
    """

    name = "auto"

    def __init__(
        self,
        backend: Backend = "inductor",
        *,
        functions: Engine | None = None,
        compile_on: str = "background",
        torchscript: bool = False,
        **options: Any,
    ) -> None:
        if compile_on not in COMPILE_ON:
            raise ConfigurationError(
                f"phi_torch_jit: compile_on must be one of {COMPILE_ON}, got {compile_on!r}."
            )
        super().__init__(backend, functions=functions, torchscript=torchscript, **options)
        self.compile_on = compile_on

    def tracing_session(self, owner: str) -> contextlib.AbstractContextManager[Any] | None:
        session = _CAPTURE_LOCK.session()
        if session is None:
            note_busy(owner)
        return session

    def _block(self, graph: torch.fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> Any:
        """A block of a captured loop: with ``compile_on="background"`` it runs straight-line
        at once and the backend compiles it on the compile thread (:mod:`._block_tiers`), so a
        first call does not wait for inductor; on the caller's thread otherwise, and for a
        block calling our ops (their owners must outlive a compile)."""
        target = Compilable(graph, inputs, self, len(inputs))
        ours = any(str(n.target).startswith("phi_torch_jit") for n in graph.graph.nodes)
        if self.compile_on == "caller" or ours:
            return target.compile()
        ahead = ahead_of(target)  # compiled in a worker process first, where it can be
        return BackgroundBlock(graph, target.compile, _CAPTURE_LOCK, remembered(target), ahead)

    def compile_module(
        self, module: nn.Module, example_inputs: tuple[torch.Tensor, ...], label: str
    ) -> CompiledModule:
        state = (*module.parameters(), *module.buffers())
        if not _CAPTURE_LOCK.acquire(blocking=False):  # the compile thread traces now
            note_busy(label)
            raise NotNow()
        try:
            graph = _capture(module, example_inputs, state, label)
        finally:
            _CAPTURE_LOCK.release()
        program = TieredProgram(graph, state, example_inputs, self, label)
        return CompiledModule(
            program,
            (),
            _uses_rng(graph),
            (),
            program.start,
            program.describe,
            program.wait,
            program.keep_alive,
            program.close,
            defer=program.start_for_values,
            sizes_left_dynamic=sizes_left_dynamic(graph),
            on_new_program=program.listeners.append,
        )


class TieredProgram:
    """One captured graph, run by the fast tier until the compiled one replaces it.

    ``serve`` is the callable that serves calls: the fast tier behind a counter until the
    background compile replaces it, in one assignment, by the compiled program (which then
    runs with nothing in front of it). Each call runs wholly on one tier.
    """

    def __init__(
        self,
        graph: torch.fx.GraphModule,
        state: tuple[torch.Tensor, ...],
        example: tuple[torch.Tensor, ...],
        engine: AutoEngine,
        owner: str,
    ) -> None:
        self.graph = graph
        self.state = state
        self.owner = owner
        self.draws = _uses_rng(graph)
        self.target = Compilable(graph, (*example, *state), engine, len(example))
        self.on_caller = engine.compile_on == "caller"
        self.torchscript = engine.torchscript
        self.serve: Callable[..., Any] = graph.forward
        self._fast: Callable[..., Any] = graph.forward
        self.tier = "captured graph"
        self.fast_tier = ""
        self.compile_s: float | None = None
        self.switched_after_calls: int | None = None
        self.calls = 0
        self.failure: str | None = None
        self.closed = False
        self._pinned: tuple[Any, ...] = ()
        self._example = example
        self._settled = threading.Event()
        self._unsubmitted = False  # the compile waits for a call of the program (_serve_fast)
        self._submit_lock = threading.Lock()
        self._queued_at: float | None = None
        self._state_grads: Fixed = ()
        self._compiled: Callable[..., Any] = graph.forward
        self._unrolled = 0
        """Value guards of a loop unrolled by values (:meth:`start_for_values`); 0 if not."""
        self.fast_calls_after_switch = 0  # a parameter's requires_grad differed: fast tier
        self.listeners: list[Callable[[], None]] = []
        """Told when the compiled tier takes over (:attr:`CompiledModule.on_new_program`)."""
        self.warm_start = False  # inductor's caches held the program when the fast tier started
        self.in_worker = False  # compiled in a worker process, then loaded (_compile_process)
        self._load_awaited = False

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if HELD.cores:  # NOTE [a core for the compile]
            return with_fewer_threads(self.serve, *tensors, *self.state)  # type: ignore[no-any-return]
        return self.serve(*tensors, *self.state)  # type: ignore[no-any-return]

    def _serve_fast(self, *inputs: torch.Tensor) -> Any:
        """The fast tier, counting calls and queuing the compile at its second one (the
        function's third call of this signature). Not at the first: a backward after it
        compiles the custom functions' backwards, which a compile holding the tracing lock
        would make run as Python until it ends (a PhiFlow gradient step's adjoint solves ran
        as PhiML's Python CG for the 40 s of its compile); and a signature seen twice may not
        come again (a simulation's first state, built otherwise than the states its step
        returns: the compile of its program kept the next signature from being traced, and
        the demo's steps ran eagerly for the 20 s of that compile). The blocks of its captured
        loops wait for the same call: their compile holds the lock too (queued at the second
        call, a cold block compile kept the demo's next signature eager for 30 s). A compile on
        the caller's thread is done in the call. A warm start's load (:mod:`._warm_starts`) is
        awaited in the program's first call, once."""
        if self._awaits_load():
            return self.serve(*inputs)
        if self._unsubmitted and (self.calls or self.on_caller):
            self._submit()
            if self.tier != self.fast_tier:  # compiled in this call (compile_on="caller")
                return self.serve(*inputs)
        elif not self._unsubmitted:  # loops captured since (a custom backward's first backward)
            submit_pending()
        self.calls += 1
        return self._fast(*inputs)

    def _awaits_load(self) -> bool:
        """Whether this call waited for a warm start's load, which switched the tier (and for
        the remembered blocks the first call's backward captured: a custom backward's loops)."""
        if not self.warm_start or self._load_awaited or _CAPTURE_LOCK.reserved_here():
            return False
        self._load_awaited = True
        with awaited():  # the loads run without yielding to this thread, which waits
            blocks = submit_pending()  # first: the program's first calls run them
            self._submit()
            await_loads(self._settled, blocks)
        return self.tier != self.fast_tier

    def _serve_first_compiled(self, *inputs: torch.Tensor) -> Any:
        """The first call on the compiled tier: a program can compile and still fail when it
        runs (AOTAutograd on an LSTM). Then the fast tier serves this call and, unless it
        raises too (the error is the user's, raised as the compiled tier raised it), every
        later one. Our own errors (a custom function's contract broken) are raised at once.
        The random draws of the failed attempt are undone first, so the fast tier draws what
        eager code would."""
        rng = capture_rng() if self.draws else None
        try:
            result = self._serve_compiled(*inputs)
        except JitError:
            raise
        except Exception as error:
            if rng is not None:
                restore_rng(rng)
            try:
                result = self._fast(*inputs)
            except Exception:
                raise error from None
            self.failure = f"its program failed: {describe_error(error)}"
            self.tier = self.fast_tier
            self.serve = self._fast
            logger.warning(
                "phi_torch_jit: %s for %s: %s; it stays on the %s tier",
                self.target.backend_name, self.owner, self.failure, self.fast_tier,
            )  # fmt: skip
            return result
        self.serve = self._serve_second_compiled
        return result

    def _serve_second_compiled(self, *inputs: torch.Tensor) -> Any:
        """The second call on the compiled tier queues the loops the first one's backward
        captured and, on a warm start, awaits those inductor's caches hold. Then the compiled
        autograd graph fixed which parameters get gradients; without state nothing runs in
        front of the compiled program."""
        blocks = [] if self.on_caller else submit_pending()  # compiled in their first call
        if self.warm_start and not _CAPTURE_LOCK.reserved_here():
            with awaited():  # the loads run without yielding to this thread, which waits
                await_loads(self._settled, blocks)
        self.serve = self._serve_compiled if self.state else self._compiled
        return self.serve(*inputs)

    def _serve_compiled(self, *inputs: torch.Tensor) -> Any:
        """The compiled tier, unless a parameter's ``requires_grad`` (then the fast tier), dtype
        or device (``StateChanged``: a retrace) changed since the compile (``_state_meta``)."""
        now = fixed_of(self.state)
        if now != self._state_grads:
            same_placement(now, self._state_grads, str(self.owner))
            self.fast_calls_after_switch += 1
            return self._fast(*inputs)
        return self._compiled(*inputs)

    def _submit(self, blocking: bool = False) -> None:
        if self.on_caller:
            self._compile_here(blocking)
            return
        if not self._claim():
            return
        submit_pending()  # the blocks of captured loops first: the first calls run them
        if not submit_compile(self):  # interpreter exit
            self.failure = "the interpreter is exiting"
            self._settled.set()

    def start(self) -> tuple[str, ...]:
        """Build the fast tier (state and RNG are rewound by the trace stage) and queue the
        backend's compile."""
        example, self._example = self._example, ()
        inputs = (*example, *self.state)
        traceable = self.torchscript and tensor_ops_only(self.graph)
        fast = trace_graph(self.graph, inputs) if traceable else None
        self.fast_tier = "torchscript-graph" if fast is not None else "straight-line"
        self._fast = fast if fast is not None else straight_line(self.graph)
        self.serve = self._serve_fast
        self.tier = self.fast_tier
        reason = self._stays_fast()
        if reason:
            self.failure = reason
            self._settled.set()
            return (f"fast tier {self.fast_tier} only: {reason}",)
        self._state_grads = fixed_of(self.state)
        self._unsubmitted = True
        self.warm_start = not self.on_caller and remembered(self.target)
        if not self.on_caller and not self.warm_start:
            start_worker_for(self.target)
        return ()

    def start_for_values(self, guards: int) -> tuple[str, ...]:
        """:meth:`start` for a program whose traced Python branched on ``guards`` tensor
        values: more than ``UNROLLED`` is a loop unrolled by values, which stays on the fast
        tier (the backend's compile of one such path took minutes, and held the capture lock
        that every other compile waits for)."""
        self._unrolled = guards if guards > UNROLLED else 0
        return self.start()

    def _stays_fast(self) -> str:
        if self._unrolled:
            return (
                f"its traced Python branched on {self._unrolled} tensor values (a loop "
                "unrolled by values, a path that rarely repeats)"
            )
        if self.target.disabled:
            return "disable=True"
        if any_autocast():
            return "autocast is on (the background thread would compile without it)"
        return ""

    def keep_alive(self, owners: tuple[Any, ...]) -> None:
        """Hold the owners of the graph's custom ops until the compile is done: a dropped
        specialization would otherwise remove ops the backend is tracing (a segfault)."""
        self._pinned = owners

    def close(self) -> None:
        """The specialization was dropped: a compile not yet started will not start."""
        self.closed = True

    def upgrade(self, locked: bool = False) -> None:
        """Compile with the backend and switch to it (on the background thread, or on the
        caller's, holding the capture lock already, with ``compile_on="caller"``)."""
        if self.closed:
            self.failure = "the specialization was dropped before its compile started"
            self._pinned = ()
            self._settled.set()
            return
        try:
            start = time.perf_counter()
            compiled = self._compile(locked)
            self.compile_s = time.perf_counter() - start
            self.switched_after_calls = self.calls
            self._compiled = compiled
            self.serve = self._serve_first_compiled
            self.tier = self.target.backend_name
            for listener in self.listeners:
                listener()
        except Exception as error:  # any backend failure: the fast tier is right, only slower
            self.failure = describe_error(error)
            (logger.debug if exiting() else logger.warning)(
                "phi_torch_jit: %s for %s failed; it stays on the %s tier: %s",
                self.target.backend_name, self.owner, self.fast_tier, self.failure,
            )  # fmt: skip
        except BaseException as error:  # Ctrl-C in a compile on the caller's thread
            self.failure = f"the compile was interrupted ({type(error).__name__})"
            raise
        finally:
            self._pinned = ()
            self._settled.set()

    def _compile_here(self, blocking: bool) -> None:
        """``compile_on="caller"``: compile inside this call. Unless ``blocking``, a call
        that finds another thread tracing leaves the compile to the next call."""
        if not _CAPTURE_LOCK.acquire(blocking=blocking):
            return
        try:
            if self._claim():
                self.upgrade(locked=True)
        finally:
            _CAPTURE_LOCK.release()

    def _claim(self) -> bool:
        """Whether this thread is the one that queues (or runs) the compile: exactly one
        caller of those that found it unsubmitted."""
        with self._submit_lock:
            if not self._unsubmitted:
                return False
            self._unsubmitted = False
            self._queued_at = time.perf_counter()
            return True

    def _compile(self, locked: bool) -> Callable[..., Any]:
        # FX traces in two threads at once crash torch 2.13 (a segfault in AOTAutograd): the
        # caller's captures skip while this holds the lock (NOTE [one tracing thread]).
        self.in_worker = not locked and compile_ahead(self.target)  # without the lock
        with contextlib.nullcontext() if locked else _CAPTURE_LOCK:
            return self.target.compile()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the compile finished (or failed); False if ``timeout`` s passed first.
        Queues the compile if no call did yet, and waits for the compiles of captured loops'
        blocks too (they share the compile thread with every other function's compiles)."""
        if _CAPTURE_LOCK.reserved_here():  # in a specialization: the compile waits for it
            return False
        if self._unsubmitted:
            self._submit(blocking=True)
        if not self.on_caller:
            submit_pending()
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._settled.wait(timeout):
            return False
        # the blocks of captured loops compile on the same thread (_block_tiers)
        return wait_idle(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def describe(self) -> tuple[str, ...]:
        """The tier and the compile's progress, for ``explain()``."""
        if self.failure is not None:
            return (f"tier: {self.tier} (backend compile not used: {self.failure})",)
        if self._queued_at is None:
            return (f"tier: {self.tier}; the backend compiles from the third call on",)
        if self.compile_s is None:
            waited = time.perf_counter() - self._queued_at
            return (
                f"tier: {self.tier}; {self.target.backend_name} compiling in the "
                f"background ({waited:.1f} s so far, {self.calls} call(s) served meanwhile)",
            )
        where = "the caller's thread" if self.on_caller else "a background thread"
        where += ", expected in inductor's caches (a warm start)" if self.warm_start else ""
        where += " (compiled in a worker process, then loaded)" if self.in_worker else ""
        lines: tuple[str, ...] = (
            f"tier: {self.tier} (compiled in {self.compile_s:.1f} s on {where}; "
            f"switched after {self.switched_after_calls} call(s) on the {self.fast_tier} tier)",
        )
        if self.fast_calls_after_switch:
            lines += (
                f"{self.fast_calls_after_switch} later call(s) ran on the {self.fast_tier} "
                "tier: a parameter's requires_grad differed from the compile's",
            )
        return lines
