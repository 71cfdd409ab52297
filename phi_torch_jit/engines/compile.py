"""Engine ``"compile"``: the wrapper captured as an FX graph, compiled by a torch.compile backend.

torch.compile's front end (dynamo) would trace through our record and replay Python, and it
breaks the graph at every data-dependent loop of a custom function. This engine avoids both:

1. The wrapper module is captured once as an FX graph (:mod:`._capture`): each custom call one
   node of its ``phi_torch_jit::`` op, the Python of the user function, the modules and their
   hooks gone.
2. The backend is called on that graph directly (``compile_fx`` for inductor),
   forward and backward at once, in the first call of the jitted function (after
   the trace, module state and RNG rewound). No dynamo: nothing re-traces the
   graph, and no guard wrapper runs in front of each call (our cache key and
   module guard are the guards; a parameter whose ``requires_grad`` changed
   retraces). Our ops are opaque to the backend: their fake implementation
   produces outputs shaped like the recorded ones, and their autograd formula
   calls a second opaque op for the backward (NOTE [opaque backward] in
   docs/design.md), so the loops inside them cost no graph break and the
   backend fuses everything around them.

The bodies of custom functions (forward, and backward at the first backward) are compiled by
the ``functions`` engine, TorchScript by default: traced where that is faithful, scripted where
a loop depends on values, Python otherwise. A body whose loop depends on values has its loops
captured as compiled blocks instead (``phi_torch_jit._loops``, docs/loops.md); a PhiML solve
runs its CG captured (``adapters.phiml._cg``) when that measures faster than its traced form on
the recorded inputs.

Parameters and buffers are inputs of the compiled program, fetched from the wrapper on every
call, so ``optimizer.step()`` and ``load_state_dict`` are seen.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .._compat import (
    backend_exists,
    compile_captured,
    inductor_has_setting,
    mode_options,
    torchscript_available,
)
from .._inductor_fixes import for_inductor
from .._libraries import owned_by_library
from .._rnn_layers import lstms_unrolled
from .._state import capture_rng, restore_rng
from .._warnings import TORCHSCRIPT_NOTICE
from ..errors import ConfigurationError, JitError, NotNow, UsageError, describe_error
from ._capture import CAPTURE_LOCK, WITHOUT_GRAD, capture, uses_rng
from ._generic_sizes import fake_inputs_for, sizes_left_dynamic
from ._graph_bodies import GraphBodies
from ._looped import faster, with_captured_loops
from ._spare_core import all_threads
from ._state_meta import Fixed, StateChanged, fixed_of
from ._twice import TwiceDifferentiable, needs_twice
from ._warm_starts import remember, remembered
from .base import CompiledFunction, CompiledModule, Engine, FunctionTarget
from .torchscript import TorchScriptEngine

__all__ = ["CompileEngine", "Backend", "Compilable", "check_backend"]

logger = logging.getLogger("phi_torch_jit")

BUILT_IN_BACKENDS = frozenset(("inductor", "eager", "aot_eager", "aot_eager_decomp_partition"))
"""torch.compile backends every supported torch has: no lookup checks them."""

Backend = str | Callable[..., Any]
"""A torch.compile backend: a registered name or a callable ``(gm, example_inputs) -> callable``."""


def check_backend(backend: Backend) -> None:
    """Raise ConfigurationError now (not at the first call) unless ``backend`` is a backend.

    Names are looked up like torch.compile does: built-in backends, those registered with
    ``torch._dynamo.register_backend`` and those of the ``torch_dynamo_backends`` entry point.
    """
    if callable(backend):
        return
    if not isinstance(backend, str):
        raise UsageError(
            "phi_torch_jit: backend must be a torch.compile backend name or a callable "
            f"(gm, example_inputs) -> callable, got {type(backend).__name__}."
        )
    if backend not in BUILT_IN_BACKENDS and not backend_exists(backend):  # (imports dynamo)
        raise ConfigurationError(
            f"phi_torch_jit: unknown torch.compile backend {backend!r}; registered backends "
            f"are {torch.compiler.list_backends(exclude_tags=())}. Register yours with "
            "torch._dynamo.register_backend or pass the backend function itself."
        )


class CompileEngine(Engine):
    """Captures the wrapper with ``make_fx`` and compiles the graph with a torch.compile backend.

    Args:
        backend: any torch.compile backend: a name from ``torch._dynamo.list_backends()``
            (default ``"inductor"``), a name registered by ``torch._dynamo.register_backend``
            or the ``torch_dynamo_backends`` entry point, or a callable
            ``(gm, example_inputs) -> callable`` (also ``aot_autograd(fw_compiler=...)``).
            It is called on the captured graph directly, without dynamo.
        functions: the engine that compiles the bodies of custom functions (default
            :class:`~phi_torch_jit.engines.torchscript.TorchScriptEngine`; with
            ``torchscript=False``, or where TorchScript does not work, captured graphs run
            straight-line: :mod:`._graph_bodies`).
        torchscript: whether TorchScript may compile custom-function bodies (default True).
        **options: ``mode`` and ``options`` (inductor settings, merged as torch.compile
            does), ``disable=True`` (run the captured graph uncompiled), ``fullgraph`` (no
            effect: a captured graph is always one graph) and ``dynamic`` (only False: every
            specialization has the fixed shapes of its cache key); ``loops=False`` keeps
            loops in custom functions as the ``functions`` engine made them (default True:
            captured as compiled blocks where they can be, PhiML's CG solvers included,
            docs/loops.md). With inductor,
            ``options["fallback_random"]`` defaults to True so that random numbers are eager's.
    """

    name = "compile"
    captures_graph = True
    keeps_grad_mode = True
    keeps_functorch = False
    captures_autograd = True

    def __init__(
        self,
        backend: Backend = "inductor",
        *,
        functions: Engine | None = None,
        torchscript: bool = True,
        **options: Any,
    ) -> None:
        check_backend(backend)
        _quiet_import_notice()
        unknown = set(options) - {"mode", "options", "fullgraph", "dynamic", "disable", "loops"}
        if unknown:
            raise UsageError(
                f"phi_torch_jit: unknown torch.compile option(s) {sorted(unknown)}; accepted: "
                "mode, options, fullgraph, dynamic, disable, loops."
            )
        if options.get("dynamic"):
            raise ConfigurationError(
                f"phi_torch_jit: engine {self.name!r} compiles each specialization for the "
                "shapes of its cache key; dynamic=True is not supported (a new shape retraces)."
            )
        self.backend = backend
        self.torchscript = torchscript
        """Whether TorchScript may serve where it works (custom-function bodies, engine
        "auto"'s fast tier); where it does not, bodies are captured graphs run straight-line."""
        self.functions = (
            functions
            if functions is not None
            else (TorchScriptEngine() if torchscript else GraphBodies(CAPTURE_LOCK))
        )
        options.setdefault("dynamic", False)
        self.options: Mapping[str, Any] = options

    def backend_settings(self) -> dict[str, Any]:
        """The inductor settings this engine compiles with (mode and options merged)."""
        mode = self.options.get("mode")
        settings = mode_options(mode) if isinstance(mode, str) else {}
        if settings.get("triton.cudagraphs") and inductor_has_setting("graph_partition"):
            # custom ops that read values on the host split the graph, instead of failing
            # the capture (phi_torch_jit._graph_safety)
            settings["graph_partition"] = True
        fidelity = _fidelity() if self.backend == "inductor" else {}  # (imports inductor)
        return {**settings, **fidelity, **(self.options.get("options") or {})}

    def compile_function(self, target: FunctionTarget) -> CompiledFunction:
        functions = self.functions
        if isinstance(functions, TorchScriptEngine) and not torchscript_available():
            functions = GraphBodies(CAPTURE_LOCK)  # TorchScript's would run bodies as Python
        compiled = functions.compile_function(target)
        if not self.options.get("loops", True):
            return compiled
        if compiled.mode == "traced" and not owned_by_library(target.loop_source):
            return compiled
        compile_graph = None if self.options.get("disable") else self._block
        looped = with_captured_loops(target, compile_graph, CAPTURE_LOCK)
        if looped is None:
            return compiled
        if compiled.mode == "traced":  # a library's traced solve (PhiML's, CG scripted): Python
            # around a captured CG, it is 1.5x faster on a pipe flow, 2x slower on a Karman
            # vortex street (PhiML's Python around a short solve): the faster one serves
            return faster(target, looped, compiled)
        return looped

    def _block(self, graph: torch.fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> Any:
        """The backend's program for a block of loop iterations (``phi_torch_jit._loops``);
        the caller holds the capture lock."""
        return Compilable(graph, inputs, self, len(inputs)).compile()

    def compile_module(
        self, module: nn.Module, example_inputs: tuple[torch.Tensor, ...], label: str
    ) -> CompiledModule:
        state = (*module.parameters(), *module.buffers())
        with CAPTURE_LOCK:  # FX tracing (ours and the backend's) keeps process-wide state
            graph = capture(module, example_inputs, state, label)
        target = Compilable(graph, (*example_inputs, *state), self, len(example_inputs))
        program = _Program(graph, state, example_inputs, target, label)
        return CompiledModule(
            program, (), uses_rng(graph), (), program.warm_up,
            defer=program.compile_on_reuse, served=program.served,
            sizes_left_dynamic=sizes_left_dynamic(graph),
            on_new_program=program.listeners.append,
        )  # fmt: skip

    def __repr__(self) -> str:
        backend = self.backend if isinstance(self.backend, str) else repr(self.backend)
        return f"<{type(self).__name__} backend={backend}>"


def _fidelity() -> dict[str, bool]:
    """Inductor settings that keep eager's values: random ops draw as eager code does, and a
    cast to a narrower dtype rounds there (``.to(torch.bfloat16) / 3`` was computed in float32
    by the fused kernel: 4e-3 off eager's, probe 42b)."""
    settings = {"fallback_random": True}
    if inductor_has_setting("emulate_precision_casts"):
        settings["emulate_precision_casts"] = True
    return settings


class _Detached:
    """A backend's program whose outputs that eager returns without autograd history are
    returned detached: AOTAutograd returns every floating output as requiring grad."""

    def __init__(self, compiled: Callable[..., Any], indices: tuple[int, ...]) -> None:
        self.compiled = compiled
        self.indices = indices

    def __call__(self, *inputs: torch.Tensor) -> Any:
        outputs = list(self.compiled(*inputs))
        for i in self.indices:
            outputs[i] = outputs[i].detach()
        return outputs


class Compilable:
    """What a backend needs to compile a captured graph: the graph and its inputs' metadata
    (no tensor data is kept), the grad mode it was captured in, the backend and settings."""

    def __init__(
        self, graph: torch.fx.GraphModule, inputs: tuple[torch.Tensor, ...], engine: CompileEngine,
        n_arguments: int,
    ) -> None:  # fmt: skip
        self.graph = graph
        self.backend = engine.backend
        self.settings = engine.backend_settings()
        self.disabled = bool(engine.options.get("disable"))
        self.grad_enabled = torch.is_grad_enabled()
        self.metas = [(t.size(), t.stride(), t.dtype, t.device, t.requires_grad) for t in inputs]
        self.n_arguments = n_arguments

    def compile(self) -> Callable[..., Any]:
        """The backend's program for the graph, forward and backward; the caller holds the
        capture lock (NOTE [one tracing thread]). ``NotNow`` in a session that borrowed the
        lock from a paused compile: inductor's settings are process-wide, and a compile
        nested in another's would run with the paused one's (:mod:`._tracing_lock`)."""
        if CAPTURE_LOCK.borrowed_here():
            raise NotNow("a compile cannot start while another one is paused for its C++ build")
        # Tensors like the inputs, without their data: the backend only reads metadata.
        inputs = [
            torch.empty_strided(size, stride, dtype=dtype, device=device).requires_grad_(grad)
            for size, stride, dtype, device, grad in self.metas
        ]
        cuda = next((t.device for t in inputs if t.device.type == "cuda"), None)
        on_device = torch.cuda.device(cuda) if cuda is not None else contextlib.nullcontext()
        with torch.set_grad_enabled(self.grad_enabled), on_device, all_threads():
            graph = lstms_unrolled(self.graph) if self.grad_enabled else self.graph
            graph = for_inductor(graph) if self.backend == "inductor" else graph
            fakes = None if self.backend == "inductor" else fake_inputs_for(graph, inputs)
            settings, loads = dict(self.settings), remembered(self)  # warm, or the worker's
            compiled = compile_captured(self.backend, graph, fakes or inputs, settings, loads)
        remember(self)  # inductor's caches hold it now: a later process loads it (warm start)
        if needs_twice(self.grad_enabled, [t.requires_grad for t in inputs[: self.n_arguments]]):
            compiled = TwiceDifferentiable(compiled, self.graph)
        without_grad = self.graph.meta.get(WITHOUT_GRAD, ())
        return _Detached(compiled, without_grad) if without_grad else compiled

    @property
    def backend_name(self) -> str:
        backend = self.backend
        return backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))


class _Program:
    """The captured graph compiled by the backend -- or run uncompiled if compiling failed.

    The backend compiles in :meth:`warm_up` (so the jitted function's first call pays it, the
    backward's compile included), and the program runs once there. If either fails, the
    failure is logged once and the captured graph runs uncompiled: same values, no backend
    speed (``explain()`` says so).
    """

    def __init__(
        self,
        graph: torch.fx.GraphModule,
        state: tuple[torch.Tensor, ...],
        example: tuple[torch.Tensor, ...],
        target: Compilable,
        owner: str,
    ) -> None:
        self.graph = graph
        self.state = state
        self._example = example
        """The trace inputs, for the warm-up run only (released after it)."""
        self.target = target
        self.owner = owner
        self.serve: Callable[..., Any] = graph.forward
        self._compiled: Callable[..., Any] = graph.forward
        self._state_grads: Fixed = ()
        self._uncompiled_calls = 0
        self.listeners: list[Callable[[], None]] = []
        """Told when the compile on reuse takes over (:attr:`CompiledModule.on_new_program`)."""

    def warm_up(self) -> tuple[str, ...]:
        what = f"{self.target.backend_name}, called on the captured graph"
        if self.target.disabled:
            return (f"{what}: not compiled (disable=True); the captured graph runs uncompiled",)
        start = time.perf_counter()
        example, self._example = self._example, ()
        try:
            with CAPTURE_LOCK:
                self._compiled = self.target.compile()
            compile_s = time.perf_counter() - start
            # One run on the trace inputs (the trace stage rewinds state and RNG after it):
            # a program can compile and still fail when it runs (AOTAutograd on an LSTM).
            self._compiled(*example, *self.state)
        except Exception as error:  # any backend failure: the graph itself is fine
            failure = self._uncompiled_after(error, what)
            return (f"{what}: failed ({failure}); the captured graph runs uncompiled",)
        self._state_grads = fixed_of(self.state)
        # The compiled autograd graph fixed which parameters get gradients; without state
        # there is nothing to check, and nothing runs in front of the compiled program.
        self.serve = self._serve_checked if self.state else self._compiled
        return (f"{what}: compiled in {compile_s:.1f} s (one graph)",)

    def compile_on_reuse(self, guards: int) -> tuple[str, ...]:
        """Serve the captured graph uncompiled; compile once it served :data:`REUSE` calls.

        For a specialization whose traced Python branched on tensor values (``bool(err <
        tol)``, ``float(dt)``): such a path may never be taken again (NOTE [values that never
        repeat]), and a backend's compile of it can take minutes (inductor took over 90 s for
        a 64x64 iteration unrolled 60 times by ``bool(err < tol)``). With more than
        :data:`UNROLLED` value guards the graph is a loop unrolled by values: it is never
        compiled (the meter then serves it or eager code, whichever is faster)."""
        self._example = ()
        if guards > UNROLLED:
            self.serve = self.graph.forward
            return (
                f"{self.target.backend_name}: not compiled: its traced Python branched on "
                f"{guards} tensor values (a loop unrolled by values, a path that rarely "
                "repeats); the captured graph runs uncompiled",
            )
        self._uncompiled_calls = REUSE
        self.serve = self._serve_until_reused
        return (
            f"{self.target.backend_name}: compiles after this specialization served {REUSE} "
            "call(s) (its traced Python branched on tensor values: a path that may not "
            "repeat); the captured graph runs uncompiled until then",
        )

    def served(self) -> None:
        """A call's value guards held: the path was taken again."""
        if self._uncompiled_calls > 0:
            self._uncompiled_calls -= 1

    def _serve_until_reused(self, *inputs: torch.Tensor) -> Any:
        if self._uncompiled_calls > 0:
            return self.graph.forward(*inputs)
        with CAPTURE_LOCK:
            if self.serve == self._serve_until_reused:  # not compiled by another thread
                self.serve = self._compile_for_reuse()
        program = self.serve
        if program == self.graph.forward:  # the compile failed: nothing to check
            return program(*inputs)
        rng = capture_rng() if uses_rng(self.graph) else None
        try:  # the first compiled call: a program can compile and still fail when it runs
            return program(*inputs)
        except JitError:
            raise
        except Exception as error:
            if rng is not None:  # the failed attempt's draws are undone: eager's draws follow
                restore_rng(rng)
            try:
                result = self.graph.forward(*inputs)
            except Exception:
                raise error from None  # the graph raises too: the error is the user's
            self.serve = self.graph.forward
            self._uncompiled_after(error, f"{self.target.backend_name} program")
            return result

    def _compile_for_reuse(self) -> Callable[..., Any]:
        try:
            self._compiled = self.target.compile()
        except Exception as error:
            self._uncompiled_after(error, self.target.backend_name)
            return self.graph.forward
        self._state_grads = fixed_of(self.state)
        for listener in self.listeners:
            listener()
        return self._serve_checked if self.state else self._compiled

    def _uncompiled_after(self, error: Exception, what: str) -> str:
        """Log once that ``what`` failed and the captured graph runs uncompiled."""
        failure = describe_error(error)
        logger.warning(
            "phi_torch_jit: %s of %s failed, the captured graph runs uncompiled: %s",
            what, self.owner, failure,
        )  # fmt: skip
        return failure

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.serve(*tensors, *self.state)  # type: ignore[no-any-return]

    def _serve_checked(self, *inputs: torch.Tensor) -> Any:
        """The compiled program, unless a parameter's ``requires_grad``, dtype or device
        changed since the compile (a layer frozen or unfrozen; ``module.double()``, ``.to()``,
        ``p.data = p.data.half()``, which keep the parameter objects): its backward would
        silently give that parameter no gradient, and inductor's kernels would read the new
        storage as the old dtype (garbage, or past its end). The module guard then sees the
        change and the function retraces (NOTE [module guards])."""
        if fixed_of(self.state) != self._state_grads:
            raise StateChanged(
                f"phi_torch_jit: {self.owner}: a parameter's requires_grad, dtype or device "
                "changed since the compile"
            )
        return self._compiled(*inputs)


REUSE = 2
"""Calls a value-guarded specialization serves uncompiled (guards held) before the backend
compiles it."""

UNROLLED = 16
"""More value guards than this: a loop unrolled by tensor values, never compiled."""


def _quiet_import_notice() -> None:
    """Import ``torch.utils.mkldnn`` without torch.jit's notice (torch's own deprecation), so
    that inductor's import, at the first compile, maybe on the compile thread, gives none.
    Not inductor itself: 1-2 s of a process's first ``jit()`` (session 41)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", TORCHSCRIPT_NOTICE, Warning)
        import torch.utils.mkldnn  # noqa: F401
