"""Compiling a captured graph without dynamo (:func:`compile_captured`): its backward with
its forward, off the caller's thread for engine auto without rewinding the caller's random
draws, with inductor's on-disk caches and decompositions; and inductor's settings and
torch.compile's backend names."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from ._builds import wrap_cpp_builds
from ._private import (
    COMPILE_FX,
    DECOMPOSITIONS,
    FAKE_MODE,
    FUNCTORCH_CONFIG_SAVE,
    INDUCTOR,
    INDUCTOR_CACHE_DIR,
    INDUCTOR_CONFIG_SAVE,
    INVALID_BACKEND,
    LOOKUP_BACKEND,
    MAKE_FALLBACK,
    MODE_OPTIONS,
    NON_LAZY_BACKWARD,
    PRESERVE_RNG,
    SHAPE_ENV,
)
from ._vec_isa import vec_isa_settings
from ._warm_load import headers_skipped, keep_torch_key, rebuilt_if_broken

_logger = logging.getLogger("phi_torch_jit")


def backend_exists(name: str) -> bool:
    """Whether torch.compile knows a backend by this name (built in, registered or an entry
    point)."""
    try:
        LOOKUP_BACKEND.find()(name)
    except INVALID_BACKEND.find():
        return False
    return True


def import_inductor() -> None:
    """Import inductor's compiler (a few seconds, once per process)."""
    INDUCTOR.find()


def compile_captured(
    backend: Any,
    graph: torch.fx.GraphModule,
    inputs: list[torch.Tensor],
    patches: dict[str, Any],
    cached: bool = False,
) -> Callable[..., Any]:
    """Compile a captured graph with a torch.compile backend, without dynamo and without
    running it; the backward is compiled now too (not at the first backward).

    ``backend``: ``"inductor"`` (``patches`` are inductor settings), another registered name,
    or a callable ``(gm, example_inputs) -> callable``. ``cached``: inductor's caches are
    expected to hold the program (a warm start, or a compile the worker process did), so its
    C++ header is not precompiled (``_warm_load``); a wrong expectation only slows a build.
    """
    _rng_kept_off_this_thread()
    _COMPILING.active = True
    try:
        loading = headers_skipped() if cached else contextlib.nullcontext()
        with backward_compiled_with_forward(), loading:
            return _compile_now(backend, graph, inputs, patches)
    finally:
        _COMPILING.active = False


def backward_compiled_with_forward() -> contextlib.AbstractContextManager[Any]:
    """AOTAutograd compiles the backward graph together with the forward (by default it waits
    for the first backward: a second call of a jitted function would pay it)."""
    import torch._functorch.config as functorch_config  # not imported by torch on 2.15

    NON_LAZY_BACKWARD.find()
    return functorch_config.patch(force_non_lazy_backward_lowering=True)  # type: ignore[no-any-return]


def _compile_now(
    backend: Any, graph: torch.fx.GraphModule, inputs: list[torch.Tensor], patches: dict[str, Any]
) -> Callable[..., Any]:
    if backend == "inductor":
        keep_torch_key()  # inductor's hash of torch's sources, once per machine
        wrap_cpp_builds()  # its C++ compiler runs inside our hook (engine auto lends its lock)
        # Inductor's on-disk caches (FX graph, AOTAutograd) need a fake mode with a shape
        # environment, as dynamo would give; without one they are bypassed ("No shape env").
        fake_mode = FAKE_MODE.find()(shape_env=SHAPE_ENV.find()())
        fakes = [fake_mode.from_tensor(t, static_shapes=True) for t in inputs]
        # With a C++ (or FX) wrapper, inductor takes the example inputs from the placeholders'
        # metadata, not from its arguments: the capture's fakes there lack requires_grad, and
        # the program would be compiled without a backward (outputs that silently do not
        # require grad).
        placeholders = [node for node in graph.graph.nodes if node.op == "placeholder"]
        for node, fake in zip(placeholders, fakes, strict=True):
            node.meta["val"] = fake
        on_cpu = all(t.device.type == "cpu" for t in inputs)
        if on_cpu:  # the probe of vector instruction sets, once per machine
            patches = {**vec_isa_settings(), **patches}
        table = _decompositions(patches) if on_cpu else None
        if on_cpu:
            _fall_back_to_kept_ops()
        if on_cpu and _cpp_wrapper_pays(patches) and only_torchs_ops(graph):
            try:
                with _without_shim_notices():
                    return rebuilt_if_broken(lambda: COMPILE_FX.find()(  # type: ignore[no-any-return]
                        graph, fakes, config_patches={**patches, "cpp_wrapper": True},
                        decompositions=table,
                    ))  # fmt: skip
            except Exception as error:  # any failure: the Python wrapper serves instead
                _logger.info("inductor's C++ wrapper failed, its Python wrapper serves: %s", error)
        return rebuilt_if_broken(  # type: ignore[no-any-return]
            lambda: COMPILE_FX.find()(graph, fakes, config_patches=patches, decompositions=table)
        )
    compiler = backend if callable(backend) else LOOKUP_BACKEND.find()(backend)
    return compiler(graph, inputs)  # type: ignore[no-any-return]


def _cpp_wrapper_pays(patches: dict[str, Any]) -> bool:
    """Whether a CPU graph is compiled with inductor's C++ wrapper: unless the settings name
    ``cpp_wrapper`` (or the process set it) or autotune (which would run the fake inputs);
    only for graphs of torch's own ops (:func:`only_torchs_ops`).

    The wrapper calls the graph's kernels and ATen ops from C++ instead of generated Python:
    on steps of many small kernels that Python was a quarter of the compiled step (a PINN's
    training step 0.69x -> 0.62x eager, a Hamiltonian flow's 0.31x -> 0.25x; docs/benchmarks.md),
    and compiling it took no longer (the kernels are C++ either way)."""
    import torch._inductor.config as inductor_config

    if "cpp_wrapper" in patches or inductor_config.cpp_wrapper:
        return False
    return not any(
        patches.get(name, getattr(inductor_config, name, False))
        for name in ("max_autotune", "max_autotune_gemm", "fx_wrapper")
    )


class _NoShimNotices(logging.Filter):
    """Drops inductor's notice that an ATen op (``grid_sampler_2d``, kept undecomposed on the
    CPU) has no C shim and is called through its proxy executor: how the C++ wrapper calls it,
    nothing a user can act on; it came once per compile of every advection step."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "c-shim" not in record.getMessage()


@contextlib.contextmanager
def _without_shim_notices() -> Any:
    ir_logger, quiet = logging.getLogger("torch._inductor.ir"), _NoShimNotices()
    ir_logger.addFilter(quiet)
    try:
        yield
    finally:
        ir_logger.removeFilter(quiet)


_TORCHS = frozenset({"aten", "prims"})


def only_torchs_ops(graph: torch.fx.GraphModule) -> bool:
    """Whether every op of the graph is torch's own: the C++ wrapper calls other ops (ours,
    a library's) through the dispatcher from C++, where the Python exception they raise
    becomes a bare RuntimeError ("aoti_torch_call_dispatcher ... failed"), and our checks
    (a refused ctx value, a guard inside a custom function) must reach the caller typed."""
    return all(
        getattr(node.target, "namespace", "aten") in _TORCHS
        for node in graph.graph.nodes
        if node.op == "call_function"
    )


_KEPT_ON_CPU = ("grid_sampler_2d",)
"""aten ops that inductor decomposes but that run better as ATen's CPU kernels: decomposed,
``grid_sampler_2d`` (semi-Lagrangian advection) made bench_peers' training step compile in 90 s
instead of 55 s and run 1.2x slower (benchmarks.md, run 4)."""


def _kept_on_cpu() -> tuple[str, ...]:
    """:data:`_KEPT_ON_CPU` where inductor can fall back to the ops left out of the table it is
    given (torch 2.13+); torch 2.11 asserts "both a fallback and a decomp" for them."""
    parameters = inspect.signature(MAKE_FALLBACK.find()).parameters
    return _KEPT_ON_CPU if "get_decomp_fn" in parameters else ()


_FALLBACKS_MADE: list[bool] = []
_FALLBACKS_LOCK = threading.Lock()


def _fall_back_to_kept_ops() -> None:
    """Register ATen fallbacks for :func:`_kept_on_cpu` ops, once per process, as inductor
    would at their first lowering, but without its check that refuses (``AssertionError:
    make_fallback(aten.grid_sampler_2d.default): a decomposition exists``) wherever the
    environment variable ``CI`` is set (GitHub Actions, GitLab CI): there every compile of a
    step that samples a grid failed and ran uncompiled. The layout is left free, as inductor's
    own implicit fallback leaves it for these ops. Other compiles are unaffected: a table that
    decomposes the op never lowers it."""
    with _FALLBACKS_LOCK:
        if _FALLBACKS_MADE:
            return
        for name in _kept_on_cpu():
            MAKE_FALLBACK.find()(
                getattr(torch.ops.aten, name).default, warn=False, override_decomp=True
            )
        _FALLBACKS_MADE.append(True)


def _decompositions(patches: dict[str, Any]) -> dict[Any, Any]:
    """Inductor's decomposition table for these settings, without :data:`_KEPT_ON_CPU`."""
    return _Decompositions(tuple(sorted(patches.items())))


class _Decompositions(dict[Any, Any]):
    """The table, pickled as the call that makes it: inductor's cache keys pickle the table
    they are given, and some of its entries (C++ functions) cannot be pickled, which made
    every compile bypass the on-disk caches (no warm start)."""

    def __init__(self, settings: tuple[tuple[str, Any], ...]) -> None:
        import torch._inductor.config as inductor_config

        with inductor_config.patch(dict(settings)):
            table = DECOMPOSITIONS.find()()
        kept = {getattr(torch.ops.aten, name) for name in _kept_on_cpu()}
        super().__init__(
            (op, fn) for op, fn in table.items() if getattr(op, "overloadpacket", op) not in kept
        )
        self.settings = settings

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Decompositions, (self.settings,))


_COMPILING = threading.local()
"""``active``: this thread compiles a captured graph off its caller's thread."""
_RNG_PATCHED: list[bool] = []


def _rng_kept_off_this_thread() -> None:
    """Make torch's ``preserve_rng_state`` a no-op on threads compiling for us (once per
    process; other threads keep torch's behaviour). The compile traces with fake tensors and
    draws nothing; restoring a state saved before it would rewind what the caller drew
    meanwhile (a repeated random stream; found by tests/test_auto_engine.py)."""
    if _RNG_PATCHED:
        return
    original = PRESERVE_RNG.find()

    @contextlib.contextmanager
    def preserve_rng_state() -> Any:
        if getattr(_COMPILING, "active", False):
            yield
            return
        with original():
            yield

    for name in ("torch._dynamo.utils", "torch._functorch.aot_autograd"):
        module = importlib.import_module(name)
        if getattr(module, "preserve_rng_state", None) is original:
            module.preserve_rng_state = preserve_rng_state  # type: ignore[attr-defined]
    _RNG_PATCHED.append(True)


def inductor_has_setting(name: str) -> bool:
    """Whether this torch's inductor has the setting ``name`` (``graph_partition``: 2.8+)."""
    import torch._inductor.config as inductor_config

    return hasattr(inductor_config, name)


def inductor_cache_dir() -> str:
    """Inductor's cache directory: ``TORCHINDUCTOR_CACHE_DIR``, else its default."""
    return str(INDUCTOR_CACHE_DIR.find()())


def inductor_caches_on() -> bool:
    """Whether inductor keeps compiled programs on disk (its FX graph cache, on by default)."""
    import torch._inductor.config as inductor_config

    return bool(inductor_config.fx_graph_cache) and not inductor_config.force_disable_caches


def process_compile_settings() -> dict[str, bytes]:
    """Inductor's and AOTAutograd's settings of this process, pickled: a compile in another
    process that adopts them (:func:`adopt_compile_settings`) has this process's cache keys."""
    import torch._functorch.config  # noqa: F401  (not imported by torch on 2.15)

    return {
        "torch._inductor.config": INDUCTOR_CONFIG_SAVE.find()(),
        "torch._functorch.config": FUNCTORCH_CONFIG_SAVE.find()(),
    }


def adopt_compile_settings(saved: dict[str, bytes]) -> None:
    """Take over another process's :func:`process_compile_settings`."""
    for name, pickled in saved.items():
        importlib.import_module(name).load_config(pickled)


def mode_options(mode: str) -> dict[str, Any]:
    """The inductor settings of a torch.compile ``mode``."""
    return dict(MODE_OPTIONS.find()(mode))
