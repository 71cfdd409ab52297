"""Every private torch API phi_torch_jit uses, in one table.

torch moves private APIs between releases (2.15 removed ``_is_fx_tracing_flag`` and made
``Function.apply`` a C-level classmethod), so when torch changes, this is the table to
read. Each entry of :data:`PRIVATE_APIS` names the API (newest spelling first), why no public
API serves, and which module uses it. :func:`missing_private_apis` lists those the running
torch lacks: ``tests/test_compat.py`` fails on such a torch with their names, and a call that
needs a missing one raises :class:`~phi_torch_jit.errors.TorchVersionError` naming it, instead
of an AttributeError deep inside a jitted call."""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import TorchVersionError
from ._version import TESTED_TORCH, TORCHSCRIPT_NOTICE


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
DISABLED_TORCH_FUNCTION = _api(
    "torch._C._disabled_torch_function_impl",
    "what a tensor subclass sets as __torch_function__ to opt out: torch's fast-path check, "
    "answered without our record mode, must tell such a class from one that overrides it",
    "_fast_paths",
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
    "adapters.phiml._graph_capture",
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
QUEUE_CALLBACK = _api(
    "torch.autograd.Variable._execution_engine.queue_callback",
    "the meter times a step's backward to its end: a callback the autograd engine runs when "
    "the running backward pass finishes (DDP and FSDP use it; no public hook says when)",
    "_meter",
)
BACKWARD_HOOK_FUNCTION = _api(
    "torch.nn.modules._functions.BackwardHookFunction",
    "the autograd.Function behind module backward hooks must pass through our interception",
    "_function",
)
BACKWARD_NODE = _api(
    "torch.autograd.function.BackwardCFunction",
    "every apply, under any name (op = F.apply bound at import), builds a node of a subclass "
    "whose _forward_cls is the Function; no public hook sees an apply",
    "_function",
)
FX_PATCHER = _api(
    "torch.fx._symbolic_trace._Patcher.patch_method",
    "FX's tracer patches nn.Module.__call__ for every thread: eager modules of the caller "
    "raised NameError during a background compile; made per thread (no public setting)",
    "engines._tracing_lock",
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
SIDE_EFFECTFUL = _api(
    "torch.fx.node._side_effectful_functions",
    "an op whose forward runs Python or a library's checks must not be dropped as dead code "
    "when its outputs are unused (eager runs it: PhiML's Diverged, SolveTape entries); "
    "torch.fx.node.has_side_effect adds to this set but nothing removes from it, and our ops "
    "are removed with their compiled program",
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
SAVED_TENSOR_HOOKS = _api(
    "torch._C._autograd._top_saved_tensors_default_hooks",
    "whether saved-tensor hooks (saved_tensors_hooks, save_on_cpu) are active around a call, "
    "whose compiled backward would not call them; no public query exists",
    "_specialization",
)
FUNCTION_MODES = _api(
    "torch._C._len_torch_function_stack",
    "one C call telling whether a torch-function mode is active (torch.set_default_device "
    "keeps one): read on every jitted call, where the public torch.get_default_device costs "
    "microseconds",
    "_specialization",
)
FUNCTION_MODE_AT = _api(
    "torch._C._get_function_stack_at",
    "which torch-function modes are active around a jitted call (a mode of the user's makes "
    "it run eagerly); read only where FUNCTION_MODES says one is, no public query",
    "_specialization",
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
MAKE_FALLBACK = _api(
    "torch._inductor.lowering.make_fallback",
    "whether an op left out of the decomposition table can fall back to ATen: torch 2.13+ checks "
    "the table a compile was given (parameter get_decomp_fn), torch 2.11 the global one, so "
    "there keeping grid_sampler_2d failed every compile of a step that samples a grid; also "
    "registers that fallback, without the check that refuses it where the variable CI is set",
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
    "engines._light, engines._merge_repeated",
)
EAGER_FUNCTIONS = _api(
    "torch._C._VariableFunctions",
    "the C functions behind torch.<op>: calling them skips OpOverload's Python __call__",
    "engines._light",
)
CPP_BUILD = _api(
    "torch._inductor.cpp_builder._run_compile_cmd",
    "inductor's C++ compiler subprocess, which a compile thread waits for without tracing: "
    "engine auto lends its tracing lock around it (no public hook exists)",
    "_compat._builds, engines._capture",
)
VEC_ISA_LIST = _api(
    "torch._inductor.cpu_vec_isa.valid_vec_isa_list",
    "the vector instruction sets inductor probes before its first CPU compile in a process "
    "(about a second): probed once per machine, and the answer kept (no public API)",
    "_compat._vec_isa",
)
VEC_ISA = _api(
    "torch._inductor.cpu_vec_isa.VecISA",
    "its check_build builds and loads a probe program (AVX-512 BF16, VNNI, AMX) in every "
    "process: the answers are kept per machine (no public API)",
    "_compat._vec_isa",
)
INDUCTOR_CACHE_DIR = _api(
    "torch._inductor.runtime.cache_dir_utils.cache_dir",
    "inductor's cache directory (TORCHINDUCTOR_CACHE_DIR or its default), where the probe's "
    "answer is kept beside inductor's own caches",
    "_compat._vec_isa",
)
TORCH_KEY = _api(
    "torch._inductor.codecache.torch_key",
    "inductor's hash of torch's sources (0.12-0.17 s per process, part of its cache keys): "
    "kept per installation and set with its set(), as inductor's compile workers do",
    "_compat._warm_load",
)
PRECOMPILE_HEADER = _api(
    "torch._inductor.codecache._precompile_header",
    "preprocesses a C++ header before inductor looks whether a library is on disk: skipped "
    "while a compile is expected to load (no public setting skips it without changing the "
    "cache keys)",
    "_compat._warm_load",
)
INDUCTOR_CONFIG_SAVE = _api(
    "torch._inductor.config.save_config",
    "inductor's settings of this process, pickled, for a compile in a worker process whose "
    "cache keys must equal this process's (load_config there; no public API)",
    "_compat._inductor",
)
FUNCTORCH_CONFIG_SAVE = _api(
    "torch._functorch.config.save_config",
    "AOTAutograd's settings of this process, pickled, for the same worker process",
    "_compat._inductor",
)
PYTREE = _api(
    "torch.utils._pytree",
    "classes a user registered with torch's pytree (register_pytree_node), flattened and "
    "rebuilt by the pytree adapter (torch has no public pytree module)",
    "adapters.pytree",
)

PRIVATE_APIS: tuple[PrivateAPI, ...] = (
    TRACING_STATE, SET_TRACING_STATE, VALUE_TRACE, GRAPH_EXECUTOR_OPTIMIZE,
    SET_GRAPH_EXECUTOR_OPTIMIZE, VERSION_COUNTER, IS_FAKE, DISABLE_MODES, CURRENT_DISPATCH_MODE,
    DISABLED_TORCH_FUNCTION,
    TORCH_C, PROXY_TENSOR, ENGINE_RUN_BACKWARD, QUEUE_CALLBACK, BACKWARD_HOOK_FUNCTION,
    BACKWARD_NODE, FX_PATCHER, GLOBAL_HOOKS, TENSOR_BASE, LIBRARY_DESTROY, SIDE_EFFECTFUL,
    LOOKUP_BACKEND, INVALID_BACKEND, INDUCTOR, TENSOR_IS_VIEW, TENSOR_VERSION, TRACER_WARNING,
    SET_GRAD_ENABLED, FUNCTORCH_STACK, ANY_AUTOCAST, FUNCTION_MODES, FUNCTION_MODE_AT,
    FUNCTORCH_CONFIG, KEEP_GRAPH, COMPILE_FX, MODE_OPTIONS, DECOMPOSITIONS, MAKE_FALLBACK,
    NON_LAZY_BACKWARD, PRESERVE_RNG, FAKE_MODE, SHAPE_ENV, OP_OVERLOAD, EAGER_FUNCTIONS, PYTREE,
    CPP_BUILD, VEC_ISA, VEC_ISA_LIST, INDUCTOR_CACHE_DIR, TORCH_KEY, PRECOMPILE_HEADER,
    INDUCTOR_CONFIG_SAVE, FUNCTORCH_CONFIG_SAVE, SAVED_TENSOR_HOOKS,
)  # fmt: skip
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
