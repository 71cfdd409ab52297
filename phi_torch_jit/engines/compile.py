"""Engine ``"compile"``: the wrapper captured as an FX graph, then ``torch.compile``.

torch.compile's front end (dynamo) would have to trace through our record and
replay Python, and it breaks the graph at every data-dependent loop of a
custom function. This engine avoids both:

1. The wrapper module is run once under ``make_fx`` on real tensors, with the
   parameters and buffers of the recorded modules passed as extra inputs. The
   replay cursor is active as for any trace, so each custom call appears as one
   node of its ``phi_torch_jit::`` op; the Python of the user function, the
   modules and their hooks is gone from the graph.
2. That graph is handed to ``torch.compile(graph, backend=...)``. Our ops are
   opaque to it: their fake implementation produces outputs shaped like the
   recorded ones, and their autograd formula calls a second opaque op for the
   backward (NOTE [opaque backward] in docs/design.md), so the loops inside
   them cause no graph break and the backend fuses everything around them.
3. The compiled program is run once on the trace inputs, so the backend's
   compile time, its backward's included, is paid by the first call of the
   jitted function, not the second (module state and RNG are rewound
   afterwards, like after any trace).

The bodies of custom functions (forward, and backward at the first backward)
are compiled by the ``functions`` engine, TorchScript by default: traced where
that is faithful, scripted where a loop depends on values, Python otherwise.

Parameters and buffers are inputs of the compiled program, fetched from the
wrapper on every call, so ``optimizer.step()`` and ``load_state_dict`` are seen.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .._compat import (
    backend_exists,
    backward_compiled_with_forward,
    dynamo_counters,
    fx_tracing,
    import_inductor,
)
from .._warnings import TORCHSCRIPT_NOTICE
from ..errors import ConfigurationError, RunEagerly, TraceError, UsageError, ValueNotCaptured
from .base import (
    RANDOM_OPS,
    CompiledFunction,
    CompiledModule,
    Engine,
    FunctionTarget,
    captured_tensor_message,
)
from .torchscript import TorchScriptEngine

__all__ = ["CompileEngine", "Backend", "check_backend"]

logger = logging.getLogger("phi_torch_jit")

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
    if not backend_exists(backend):
        raise ConfigurationError(
            f"phi_torch_jit: unknown torch.compile backend {backend!r}; registered backends "
            f"are {torch.compiler.list_backends(exclude_tags=())}. Register yours with "
            "torch._dynamo.register_backend or pass the backend function itself."
        )


class CompileEngine(Engine):
    """Captures the wrapper with ``make_fx`` and compiles it with ``torch.compile``.

    Args:
        backend: any torch.compile backend: a name from ``torch._dynamo.list_backends()``
            (default ``"inductor"``), a name registered by ``torch._dynamo.register_backend``
            or the ``torch_dynamo_backends`` entry point, or a callable
            ``(gm, example_inputs) -> callable`` (also ``aot_autograd(fw_compiler=...)``).
        functions: the engine that compiles the bodies of custom functions (default
            :class:`~phi_torch_jit.engines.torchscript.TorchScriptEngine`).
        **options: passed to ``torch.compile`` (``mode``, ``options``, ``fullgraph``,
            ``dynamic``...). ``dynamic`` defaults to False: every specialization has fixed
            shapes. With ``backend="inductor"``, ``options["fallback_random"]`` defaults to
            True so that random numbers are eager's.
    """

    name = "compile"
    captures_graph = True
    keeps_grad_mode = True
    keeps_functorch = False
    torchscript_tracing = False

    def __init__(
        self, backend: Backend = "inductor", *, functions: Engine | None = None, **options: Any
    ) -> None:
        check_backend(backend)
        _import_inductor_quietly()
        unknown = set(options) - {"mode", "options", "fullgraph", "dynamic", "disable"}
        if unknown:
            raise UsageError(
                f"phi_torch_jit: unknown torch.compile option(s) {sorted(unknown)}; accepted: "
                "mode, options, fullgraph, dynamic, disable."
            )
        self.backend = backend
        self.functions = functions if functions is not None else TorchScriptEngine()
        options.setdefault("dynamic", False)
        if backend == "inductor" and options.get("mode") is None:
            options["options"] = {"fallback_random": True, **(options.get("options") or {})}
        self.options: Mapping[str, Any] = options

    def compile_function(self, target: FunctionTarget) -> CompiledFunction:
        return self.functions.compile_function(target)

    def compile_module(
        self, module: nn.Module, example_inputs: tuple[torch.Tensor, ...], label: str
    ) -> CompiledModule:
        state = (*module.parameters(), *module.buffers())
        with _CAPTURE_LOCK:  # FX tracing (ours and the backend's) keeps process-wide state
            graph = _capture(module, example_inputs, state, label)
            # The graph's forward, not the module: global module hooks must not fire for it.
            compiled = torch.compile(graph.forward, backend=self.backend, **self.options)
        backend = self.backend if isinstance(self.backend, str) else repr(self.backend)
        what = f"torch.compile (backend {backend})"
        program = _Program(graph, compiled, state, example_inputs, what, label)
        return CompiledModule(program, (), _uses_rng(graph), (), program.warm_up)

    def __repr__(self) -> str:
        backend = self.backend if isinstance(self.backend, str) else repr(self.backend)
        return f"<{type(self).__name__} backend={backend}>"


_CAPTURE_LOCK = threading.Lock()


class _Program:
    """The captured graph, run compiled by torch.compile -- or uncompiled if compiling failed.

    The backend compiles at the first run, which :meth:`warm_up` makes (so the jitted
    function's first call pays it). If the backend fails there, the failure is logged once and
    the captured graph runs uncompiled: same values, no backend speed (``explain()`` says so).
    """

    def __init__(
        self,
        graph: torch.fx.GraphModule,
        compiled: Callable[..., Any],
        state: tuple[torch.Tensor, ...],
        example: tuple[torch.Tensor, ...],
        label: str,
        owner: str,
    ) -> None:
        self.graph = graph
        self.compiled = compiled
        self.state = state
        self._example = example
        """The trace inputs, for the warm-up run only (released after it)."""
        self.label = label
        self.owner = owner
        self.failure: str | None = None
        """Why the backend could not compile the graph (None: it did)."""

    def warm_up(self) -> tuple[str, ...]:
        with _CAPTURE_LOCK:
            before = _graph_counts()
            example, self._example = self._example, ()
            try:
                with backward_compiled_with_forward():  # else the second call would pay it
                    self.compiled(*example, *self.state)
            except Exception as error:  # any backend failure: the graph itself is fine
                self.failure = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                logger.warning(
                    "phi_torch_jit: %s of %s failed, the captured graph runs uncompiled: %s",
                    self.label, self.owner, self.failure,
                )  # fmt: skip
                return (
                    f"{self.label} failed ({self.failure}); the captured graph runs uncompiled",
                )
            graphs, breaks = (b - a for a, b in zip(before, _graph_counts()))
        return (f"{self.label}: {graphs} graph(s), {breaks} graph break(s)",)

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # An FX trace is running (any thread before torch 2.15): dynamo would refuse to run
        # compiled code ("FX to symbolically trace a dynamo-optimized function").
        if self.failure is not None or fx_tracing():
            return self.graph.forward(*tensors, *self.state)  # type: ignore[no-any-return]
        return self.compiled(*tensors, *self.state)  # type: ignore[no-any-return]


def _capture(
    module: nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    state: tuple[torch.Tensor, ...],
    label: str,
) -> torch.fx.GraphModule:
    """The wrapper's forward as an FX graph of (inputs, parameters and buffers)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    n = len(example_inputs)

    def flat(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(module(*tensors[:n]))

    try:
        graph = make_fx(flat, tracing_mode="real", pre_dispatch=True)(*example_inputs, *state)
    except RuntimeError as error:
        if _VALUE_OUT_OF_GRAPH not in str(error):
            raise
        raise ValueNotCaptured(
            "a tensor is read as a Python value that engine 'compile' cannot capture (a tensor "
            "used as a size, e.g. torch.ones(n) or x.repeat(n)); pass it as an int, or use "
            "engine 'torchscript'"
        ) from None
    _reject_captured(graph, label)
    _reject_data_dependent_shapes(graph)
    return graph


_DATA_DEPENDENT = ("nonzero.", "_unique2", "unique_dim", "unique_consecutive", "masked_select",
                   "repeat_interleave.Tensor", "bincount")  # fmt: skip
"""Ops whose output shape depends on tensor values (``nonzero_static`` is not one of them)."""


def _reject_data_dependent_shapes(graph: torch.fx.GraphModule) -> None:
    """A captured graph has the shapes of this run baked in; an op whose output shape depends
    on values (``x.nonzero()``, ``torch.unique``, ``x[mask]``) would give other calls wrong
    sizes. Such functions run eagerly (TorchScript traces those sizes dynamically)."""
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        masked = name == "aten.index.Tensor" and any(
            getattr(getattr(i, "meta", {}).get("val"), "dtype", None) in (torch.bool, torch.uint8)
            for i in node.args[1]
            if i is not None
        )
        if masked or any(op in name for op in _DATA_DEPENDENT):
            raise RunEagerly(
                f"engine 'compile' would bake the output shape of {name} (it depends on tensor "
                "values); use engine 'torchscript', or ops with static shapes (torch.where "
                "with three arguments, nonzero_static)"
            )


_VALUE_OUT_OF_GRAPH = "trying to get value out of a tracing tensor"


def _import_inductor_quietly() -> None:
    """Import inductor now, without the notice torch.jit gives while inductor imports
    ``torch.utils.mkldnn`` (a deprecation of torch's own code, not the user's)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", TORCHSCRIPT_NOTICE, Warning)
        import_inductor()


def _graph_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process, from dynamo's counters."""
    counters = dynamo_counters()
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _reject_captured(graph: torch.fx.GraphModule, label: str) -> None:
    """Tensors that require grad but are neither inputs nor module state would lose gradients."""
    for node in graph.graph.nodes:
        if node.op == "get_attr":
            value = getattr(graph, node.target, None)
            if isinstance(value, torch.Tensor) and value.requires_grad:
                raise TraceError(captured_tensor_message(label))


def _uses_rng(graph: torch.fx.GraphModule) -> bool:
    """Whether the captured graph may draw random numbers (our ops count as may)."""
    for node in graph.graph.nodes:
        if node.op == "call_function":
            name = str(node.target)
            if name.startswith("phi_torch_jit") or any(r in name for r in RANDOM_OPS):
                return True
    return False
