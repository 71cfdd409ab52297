"""Every private torch API phi_torch_jit uses, in one place.

torch moves private APIs between releases (2.15 removed ``_is_fx_tracing_flag`` and made
``Function.apply`` a C-level classmethod), so when torch changes, this is the one module to
read. Each entry of :data:`PRIVATE_APIS` names the API (newest spelling first), why no public
API serves, and which module uses it. :func:`missing_private_apis` lists those the running
torch lacks: ``tests/test_compat.py`` fails on such a torch with their names, and a call that
needs a missing one raises :class:`~.errors.TorchVersionError` naming it, instead of an
AttributeError deep inside a jitted call.

Tested torch versions: :data:`TESTED_TORCH` (``make test`` runs the suite on each).
Nothing here imports a higher floor of the package: this is a leaf next to ``errors``.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .errors import TorchVersionError

__all__ = [
    "backward_compiled_with_forward",
    "mode_options",
    "TESTED_TORCH",
    "TracerWarning",
    "TORCHSCRIPT_NOTICE",
    "PrivateAPI",
    "PRIVATE_APIS",
    "missing_private_apis",
    "get_tracing_state",
    "set_tracing_state",
    "functorch_transform",
    "any_autocast",
    "value_trace",
    "graph_executor_optimize",
    "set_graph_executor_optimize",
    "set_version_counters",
    "is_fake",
    "grad_mode_setter",
    "disable_dispatch_modes",
    "backward_hook_function",
    "global_module_hooks",
    "tensor_conversion",
    "is_view",
    "version",
    "destroy_library",
    "backend_exists",
    "import_inductor",
    "original_function_apply",
    "compile_captured",
    "op_overload",
    "eager_functions",
    "torchscript_available",
    "VALUE_OUT_OF_GRAPH",
]

TESTED_TORCH = ("2.11.0", "2.13.0", "2.15.0")
"""torch releases the whole test suite runs on: one ``requirements/torch-<version>.txt`` each
(the Makefile's ``TORCH_VERSIONS``)."""


TORCHSCRIPT_NOTICE = r"`torch\.jit\.\w+` is (deprecated|not supported)"
"""What torch's TorchScript deprecation notices start with (2.13: DeprecationWarning;
2.15: FutureWarning; on Python 3.14: '... is not supported in Python 3.14+ and may break')."""


@dataclass(frozen=True)
class PrivateAPI:
    """One private torch API and why phi_torch_jit needs it."""

    names: tuple[str, ...]
    """Dotted paths, newest torch first; the first that resolves is used."""
    why: str
    """Why no public API serves."""
    used_by: str
    """The module of phi_torch_jit that needs it."""

    def find(self) -> Any:
        """The object behind the first name that resolves (looked up once); TorchVersionError
        if none does."""
        found = _FOUND.get(self.names, _MISSING)
        if found is not _MISSING:
            return found
        for name in self.names:
            found = _resolve(name)
            if found is not _MISSING:
                _FOUND[self.names] = found
                return found
        raise TorchVersionError(
            f"phi_torch_jit: torch {torch.__version__} has none of {', '.join(self.names)}, "
            f"which phi_torch_jit needs ({self.used_by}: {self.why}). phi_torch_jit is tested "
            f"with torch {', '.join(TESTED_TORCH)}: install one of those "
            f"(pip install torch=={TESTED_TORCH[-1]}), or report this torch version."
        )


_MISSING = object()
_FOUND: dict[tuple[str, ...], Any] = {}


def _resolve(dotted: str) -> Any:
    """Import the longest importable module prefix of ``dotted``, then follow attributes."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            with warnings.catch_warnings():  # torch's own modules script at import
                warnings.filterwarnings("ignore", TORCHSCRIPT_NOTICE, Warning)
                obj: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attr in parts[split:]:
            obj = getattr(obj, attr, _MISSING)
            if obj is _MISSING:
                return _MISSING
        return obj
    return _MISSING


def _api(names: str, why: str, used_by: str) -> PrivateAPI:
    return PrivateAPI(tuple(names.split()), why, used_by)


TRACING_STATE = _api(
    "torch._C._get_tracing_state",
    "whether torch.jit.trace is running now; torch.jit.is_tracing() also says True inside "
    "scripted code and costs a Python call more on every jitted call",
    "_jit, _custom, _value_guards",
)
SET_TRACING_STATE = _api(
    "torch._C._set_tracing_state",
    "hide a running trace while contract checks read shapes; no public API pauses a trace",
    "_custom",
)
VALUE_TRACE = _api(
    "torch._C._get_value_trace",
    "the traced graph value of a tensor, to see whether a converted value derives from shapes",
    "_value_guards",
)
GRAPH_EXECUTOR_OPTIMIZE = _api(
    "torch._C._get_graph_executor_optimize",
    "TorchScript's optimizing executor gives wrong complex gradients; no public switch",
    "engines.torchscript",
)
SET_GRAPH_EXECUTOR_OPTIMIZE = _api(
    "torch._C._set_graph_executor_optimize",
    "see torch._C._get_graph_executor_optimize",
    "engines.torchscript",
)
VERSION_COUNTER = _api(
    "torch._C._autograd._unsafe_set_version_counter",
    "buffer writes of the rewound trace pass must not look like in-place edits to autograd",
    "_state",
)
IS_FAKE = _api(
    "torch._subclasses.fake_tensor.is_fake",
    "whether AOTAutograd traces our autograd formula with fake tensors (NOTE [opaque "
    "backward]); torch.compiler has no public test for fake or functional tensors",
    "_custom_op",
)
DISABLE_MODES = _api(
    "torch.utils._python_dispatch._disable_current_modes",
    "read a real value out of a tensor while make_fx's dispatch modes are active",
    "_value_guards",
)
CURRENT_DISPATCH_MODE = _api(
    "torch.utils._python_dispatch._get_current_dispatch_mode",
    "whether make_fx's dispatch mode is active on this thread (a custom body being captured "
    "reads tensor memory directly only then)",
    "engines._graph_bodies",
)
TORCH_C = _api(
    "torch._C",
    "PhiML's torch backend reads torch._C._get_tracing_state to tell its trace pass; the view "
    "of torch it gets during our graph capture passes every other name through",
    "_phiml_graph_capture",
)
PROXY_TENSOR = _api(
    "torch.fx.experimental.proxy_tensor",
    "make_fx's dispatch (proxy_call) refuses a value read inside an op (torch.add(x, y, "
    "alpha=t), torch.ones(n) with tensors t, n); the trace phase guards such reads instead",
    "_value_guards",
)
ENGINE_RUN_BACKWARD = _api(
    "torch.autograd._engine_run_backward",
    "every torch.autograd.grad and backward() runs the engine through this name, however the "
    "caller imported grad; the capture replaces it to trace gradients as ops (no public hook)",
    "_inner_grad",
)
BACKWARD_HOOK_FUNCTION = _api(
    "torch.nn.modules._functions.BackwardHookFunction",
    "the autograd.Function behind module backward hooks must pass through our interception",
    "_function",
)
GLOBAL_HOOKS = _api(
    "torch.nn.modules.module._global_forward_pre_hooks",
    "global module hooks change what a trace bakes in; torch exposes only registration",
    "_guards",
)
TENSOR_BASE = _api(
    "torch._C.TensorBase",
    "the C implementations of tensor-to-Python conversions, to call them past our patch",
    "_value_guards",
)
LIBRARY_DESTROY = _api(
    "torch.library.Library._destroy",
    "drop our ops from torch's C++ registry when their compiled program is collected",
    "_custom_op",
)
LOOKUP_BACKEND = _api(
    "torch._dynamo.backends.registry.lookup_backend",
    "check a backend name when jit() is created, not at the first call; "
    "torch.compiler.list_backends() omits entry-point and experimental backends",
    "engines.compile",
)
INVALID_BACKEND = _api(
    "torch._dynamo.exc.InvalidBackend",
    "what lookup_backend raises for an unknown name",
    "engines.compile",
)
INDUCTOR = _api(
    "torch._inductor.compile_fx",
    "imported up front, with torch's own TorchScript notices silenced, so they do not reach "
    "users at the first compile",
    "engines.compile",
)
TENSOR_IS_VIEW = _api(
    "torch.Tensor._is_view",
    "an op may not return a view of its argument; no public test for views exists",
    "_custom_op",
)
TENSOR_VERSION = _api(
    "torch.Tensor._version",
    "the version counter autograd checks; see torch._C._autograd._unsafe_set_version_counter",
    "_state",
)
SET_GRAD_ENABLED = _api(
    "torch._C._set_grad_enabled",
    "the C function every grad-mode change goes through (no_grad, enable_grad, "
    "set_grad_enabled); the record pass watches for calls of it",
    "_reads",
)
FUNCTORCH_STACK = _api(
    "torch._C._functorch.peek_interpreter_stack",
    "whether a torch.func transform (vmap, grad) is running: a jitted function called inside "
    "one runs its Python; no public query exists",
    "_jit",
)
ANY_AUTOCAST = _api(
    "torch._C._is_any_autocast_enabled",
    "one C call telling whether autocast is on for any device (read on every jitted call; "
    "the public torch.is_autocast_enabled asks one device at a time)",
    "_jit",
)
TRACER_WARNING = _api(
    "torch.jit.TracerWarning torch.jit._trace.TracerWarning",
    "the warning torch.jit.trace gives where it bakes a value; documented, but torch.jit does "
    "not export it for type checkers",
    "engines.torchscript, _value_guards",
)
FUNCTORCH_CONFIG = _api(
    "torch._functorch.config.donated_buffer",
    "gradcheck (retain_graph=True) through engine 'compile' needs donated buffers off "
    "(documented for users in docs/engines.md); imported explicitly since torch 2.15",
    "tests, docs/engines.md",
)
KEEP_GRAPH = _api(
    "torch._C._autograd._get_current_graph_task_keep_graph",
    "whether the running backward retains its graph: a compiled program's own autograd node "
    "runs the compiled backward inside it with the same retain_graph (no public API)",
    "engines._twice",
)
COMPILE_FX = _api(
    "torch._inductor.compile_fx.compile_fx",
    "compile an already captured graph without running it (off the caller's thread for "
    "engine auto); torch.compile traces again with dynamo, compiles only when the program "
    "runs and puts a guard wrapper in front of every call",
    "engines.compile, engines.auto",
)
MODE_OPTIONS = _api(
    "torch._inductor.list_mode_options",
    "the inductor settings a torch.compile mode ('max-autotune'...) stands for",
    "engines.compile, engines.auto",
)
NON_LAZY_BACKWARD = _api(
    "torch._functorch.config.force_non_lazy_backward_lowering",
    "compile the backward with the forward (in the background, or in the first call), not at "
    "the first backward of a later call",
    "engines.auto, engines.compile",
)
PRESERVE_RNG = _api(
    "torch._dynamo.utils.preserve_rng_state",
    "AOTAutograd and inductor save the global RNG state before a compile and restore it after; "
    "on a background thread that restore rewinds the caller's draws, so it is skipped there "
    "(also patched where torch._functorch.aot_autograd imported it by name)",
    "engines.auto",
)
DECOMPOSITIONS = _api(
    "torch._inductor.decomposition.select_decomp_table",
    "inductor's decompositions for the current settings, to keep grid_sampler_2d as ATen's "
    "kernel on the CPU (decomposed, it compiled 1.6x slower and ran slower on this CPU)",
    "engines.compile, engines.auto",
)
FAKE_MODE = _api(
    "torch._subclasses.fake_tensor.FakeTensorMode",
    "the fake tensors a backend compiles from; made here with a shape environment so that "
    "inductor's on-disk caches are used (dynamo makes one the same way); the node metadata "
    "of real-tensor captures, one mode per thread",
    "engines.compile, engines.auto, _fast_capture",
)
SHAPE_ENV = _api(
    "torch.fx.experimental.symbolic_shapes.ShapeEnv",
    "the shape environment of that fake mode; inductor's cache keys are computed from it",
    "engines.auto",
)
OP_OVERLOAD = _api(
    "torch._ops.OpOverload",
    "the ops of a captured graph; their ._op is the C handle, ._schema names the op",
    "engines._light",
)
EAGER_FUNCTIONS = _api(
    "torch._C._VariableFunctions",
    "the C functions behind torch.<op>: calling them skips OpOverload's Python __call__",
    "engines._light",
)

PRIVATE_APIS: tuple[PrivateAPI, ...] = (
    TRACING_STATE,
    SET_TRACING_STATE,
    VALUE_TRACE,
    GRAPH_EXECUTOR_OPTIMIZE,
    SET_GRAPH_EXECUTOR_OPTIMIZE,
    VERSION_COUNTER,
    IS_FAKE,
    DISABLE_MODES,
    CURRENT_DISPATCH_MODE,
    TORCH_C,
    PROXY_TENSOR,
    ENGINE_RUN_BACKWARD,
    BACKWARD_HOOK_FUNCTION,
    GLOBAL_HOOKS,
    TENSOR_BASE,
    LIBRARY_DESTROY,
    LOOKUP_BACKEND,
    INVALID_BACKEND,
    INDUCTOR,
    TENSOR_IS_VIEW,
    TENSOR_VERSION,
    TRACER_WARNING,
    SET_GRAD_ENABLED,
    FUNCTORCH_STACK,
    ANY_AUTOCAST,
    FUNCTORCH_CONFIG,
    KEEP_GRAPH,
    COMPILE_FX,
    MODE_OPTIONS,
    DECOMPOSITIONS,
    NON_LAZY_BACKWARD,
    PRESERVE_RNG,
    FAKE_MODE,
    SHAPE_ENV,
    OP_OVERLOAD,
    EAGER_FUNCTIONS,
)
"""Every private torch API in use (checked by tests/test_compat.py)."""


def missing_private_apis() -> list[str]:
    """The entries of :data:`PRIVATE_APIS` that the running torch lacks, as messages."""
    missing = []
    for api in PRIVATE_APIS:
        try:
            api.find()
        except TorchVersionError as error:
            missing.append(str(error))
    return missing


class _Lazy:
    """Calls the function of a private API, looked up at the first call (imports stay cheap)."""

    def __init__(self, api: PrivateAPI) -> None:
        self.api = api
        self.__name__ = api.names[0].rsplit(".", 1)[-1]

    def __call__(self, *args: Any) -> Any:
        return self.api.find()(*args)  # find() caches the lookup


def _now_or_lazy(api: PrivateAPI) -> Callable[..., Any]:
    """Hot-path C functions are bound at import; a missing one raises when first used."""
    try:
        return api.find()  # type: ignore[no-any-return]
    except TorchVersionError:
        return _Lazy(api)


TracerWarning: type[Warning] = TRACER_WARNING.find()
"""torch.jit's TracerWarning class."""
get_tracing_state: Callable[[], Any] = _now_or_lazy(TRACING_STATE)
"""The running TorchScript trace's state, None when none runs (read on every jitted call)."""
functorch_transform: Callable[[], Any] = _now_or_lazy(FUNCTORCH_STACK)
"""The innermost running torch.func transform, None outside any (read on every jitted call)."""
any_autocast: Callable[[], bool] = _now_or_lazy(ANY_AUTOCAST)
"""Whether autocast is enabled for some device (read on every jitted call)."""
set_tracing_state: Callable[[Any], None] = _now_or_lazy(SET_TRACING_STATE)
"""Install a tracing state (None pauses the trace)."""
value_trace: Callable[[torch.Tensor], Any] = _now_or_lazy(VALUE_TRACE)
"""The graph value a tensor has in the running TorchScript trace (RuntimeError if none)."""
graph_executor_optimize: Callable[[], bool] = _now_or_lazy(GRAPH_EXECUTOR_OPTIMIZE)
"""Whether TorchScript's graph executor optimizes (this thread)."""
set_graph_executor_optimize: Callable[[bool], None] = _now_or_lazy(SET_GRAPH_EXECUTOR_OPTIMIZE)
"""Switch TorchScript's graph executor optimizations (this thread)."""
set_version_counters: Callable[[tuple[torch.Tensor, ...], tuple[int, ...]], None] = _Lazy(
    VERSION_COUNTER
)
"""Set tensors' version counters (what autograd compares to detect in-place edits)."""
is_fake: Callable[[Any], bool] = _Lazy(IS_FAKE)
"""Whether a tensor is a fake (or functional wrapper of a fake) tensor."""
disable_dispatch_modes: Callable[[], Any] = _Lazy(DISABLE_MODES)
"""Context manager: no Python dispatch mode (make_fx's) is active in the block."""

VALUE_OUT_OF_GRAPH = "trying to get value out of a tracing tensor"
"""Part of the error make_fx raises when a traced tensor's value is read (``.item()``, an op
that needs a number); torch 2.11-2.15."""


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


def grad_mode_setter() -> tuple[Any, str]:
    """(module, attribute) of torch's C function that every grad-mode change calls, so the
    record pass can watch it."""
    SET_GRAD_ENABLED.find()
    return importlib.import_module("torch._C"), "_set_grad_enabled"


def backward_hook_function() -> type:
    """The autograd.Function class torch uses to fire module backward hooks."""
    return BACKWARD_HOOK_FUNCTION.find()  # type: ignore[no-any-return]


def global_module_hooks() -> tuple[dict[Any, Any], ...]:
    """torch's global module hook dicts: forward pre, forward, backward pre, backward."""
    module = importlib.import_module("torch.nn.modules.module")
    GLOBAL_HOOKS.find()  # the first one: a clear error if torch renamed them
    return tuple(
        getattr(module, f"_global_{kind}_hooks")
        for kind in ("forward_pre", "forward", "backward_pre", "backward")
    )


def tensor_conversion(kind: str) -> Callable[..., Any]:
    """The C implementation of a tensor-to-Python conversion (``__bool__``, ``item``...)."""
    return getattr(TENSOR_BASE.find(), kind)  # type: ignore[no-any-return]


def is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of another tensor."""
    return bool(tensor._is_view())


def version(tensor: torch.Tensor) -> int:
    """The tensor's version counter (advanced by every in-place write)."""
    return int(tensor._version)


def destroy_library(library: Any) -> Callable[[], None]:
    """A callable that removes ``library``'s operators from torch's registry."""
    return LIBRARY_DESTROY.find().__get__(library)  # type: ignore[no-any-return]


def original_function_apply(descriptor: Any) -> Callable[..., Any]:
    """``(cls, *args) -> cls.apply(*args)`` for the descriptor found in
    ``torch.autograd.Function.__dict__["apply"]``.

    torch 2.13 defines ``apply`` as a Python classmethod (with ``__func__``); 2.15 as a C-level
    ``classmethod_descriptor`` (without). Binding through ``__get__`` works for both.
    """

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        return descriptor.__get__(None, cls)(*args, **kwargs)

    return apply


def compile_captured(
    backend: Any, graph: torch.fx.GraphModule, inputs: list[torch.Tensor], patches: dict[str, Any]
) -> Callable[..., Any]:
    """Compile a captured graph with a torch.compile backend, without dynamo and without
    running it; the backward is compiled now too (not at the first backward).

    ``backend``: ``"inductor"`` (``patches`` are inductor settings), another registered name,
    or a callable ``(gm, example_inputs) -> callable``.
    """
    _rng_kept_off_this_thread()
    _COMPILING.active = True
    try:
        with backward_compiled_with_forward():
            return _compile_now(backend, graph, inputs, patches)
    finally:
        _COMPILING.active = False


def graph_kept() -> bool:
    """Whether the backward running on this thread keeps its graph (``retain_graph``)."""
    return bool(KEEP_GRAPH.find()())


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
        # Inductor's on-disk caches (FX graph, AOTAutograd) need a fake mode with a shape
        # environment, as dynamo would give; without one they are bypassed ("No shape env").
        fake_mode = FAKE_MODE.find()(shape_env=SHAPE_ENV.find()())
        fakes = [fake_mode.from_tensor(t, static_shapes=True) for t in inputs]
        table = _decompositions(patches) if all(t.device.type == "cpu" for t in inputs) else None
        return COMPILE_FX.find()(graph, fakes, config_patches=patches, decompositions=table)  # type: ignore[no-any-return]
    compiler = backend if callable(backend) else LOOKUP_BACKEND.find()(backend)
    return compiler(graph, inputs)  # type: ignore[no-any-return]


_KEPT_ON_CPU = ("grid_sampler_2d",)
"""aten ops that inductor decomposes but that run better as ATen's CPU kernels: decomposed,
``grid_sampler_2d`` (semi-Lagrangian advection) made bench_peers' training step compile in 90 s
instead of 55 s and run 1.2x slower (benchmarks.md, run 4)."""


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
        kept = {getattr(torch.ops.aten, name) for name in _KEPT_ON_CPU}
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


def mode_options(mode: str) -> dict[str, Any]:
    """The inductor settings of a torch.compile ``mode``."""
    return dict(MODE_OPTIONS.find()(mode))


def op_overload() -> Any:
    """The class of the ops in captured graphs (``torch.ops.aten.add.Tensor``...)."""
    return OP_OVERLOAD.find()  # type: ignore[no-any-return]


def eager_functions() -> Any:
    """The namespace of C functions behind ``torch.<op>``."""
    return EAGER_FUNCTIONS.find()


_TORCHSCRIPT_PROBED: dict[tuple[int, int], bool] = {}


def torchscript_available() -> bool:
    """Whether ``torch.jit.trace`` and ``torch.jit.script`` work here (probed once per pair of
    those functions: PyTorch plans to remove them, and a test replaces them)."""
    key = (id(torch.jit.trace), id(torch.jit.script))
    found = _TORCHSCRIPT_PROBED.get(key)
    if found is None:
        found = _probe_torchscript()
        _TORCHSCRIPT_PROBED[key] = found
    return found


def _probe_torchscript() -> bool:
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", TORCHSCRIPT_NOTICE, Warning)
        try:
            traced = torch.jit.trace(double, (torch.ones(1),), check_trace=False)
            return bool(traced(torch.ones(1)).item() == 2.0) and callable(torch.jit.script)
        except Exception:  # removed, patched, or broken on this Python
            return False
