"""Every private torch API phi_torch_jit uses, in one place.

torch moves private APIs between releases (2.15 removed ``_is_fx_tracing_flag`` and made
``Function.apply`` a C-level classmethod), so when torch changes, this is the one package to
read. Each entry of :data:`PRIVATE_APIS` names the API (newest spelling first), why no public
API serves, and which module uses it. :func:`missing_private_apis` lists those the running
torch lacks: ``tests/test_compat.py`` fails on such a torch with their names, and a call that
needs a missing one raises :class:`~phi_torch_jit.errors.TorchVersionError` naming it, instead
of an AttributeError deep inside a jitted call.

Tested torch versions: :data:`TESTED_TORCH` (``make test`` runs the suite on each).
Nothing here imports a higher floor of the package: this is a leaf next to ``errors``.

The rest of the package imports everything from here; the submodules hold:

* ``_version``: the tested torch versions and the texts of torch's messages that are matched
  (TorchScript's deprecation notices, make_fx's value-read error);
* ``_private``: :class:`PrivateAPI` (the lookup by name, newest spelling first), the table of
  private APIs (:data:`PRIVATE_APIS`) and :func:`missing_private_apis`;
* ``_calls``: the small functions that call those APIs (the C functions read on every jitted
  call, torch's hooks, classes and modules);
* ``_inductor``: :func:`compile_captured` (a captured graph compiled without dynamo),
  inductor's decompositions and settings, torch.compile's backend names;
* ``_vec_isa``: inductor's probe of the CPU's vector instruction sets, kept on disk (once per
  machine instead of once per process);
* ``_warm_load``: inductor's hash of torch's sources kept per installation, and its
  precompiled header skipped while a compile is expected to load from its caches;
* ``_builds``: :func:`around_cpp_builds` (inductor's C++ compiler subprocess run inside a
  context of ours: engine auto lends its tracing lock there);
* this ``__init__``: the re-exports, and :func:`torchscript_available` (kept here because
  tests reset its cache, ``_TORCHSCRIPT_PROBED``, on this module).
"""

from __future__ import annotations

import warnings

import torch

from ._builds import around_cpp_builds, wrap_cpp_builds

# Besides __all__, ``name as name`` re-exports what other modules, tests and docs use.
from ._calls import (
    MODULE_HOOK_DICTS,
    TracerWarning,
    any_autocast,
    backward_hook_function,
    destroy_library,
    disable_dispatch_modes,
    eager_functions,
    function_mode_at,
    function_modes,
    functorch_transform,
    get_tracing_state,
    global_module_hooks,
    grad_mode_setter,
    graph_executor_optimize,
    is_fake,
    is_view,
    kept_though_unused,
    op_overload,
    original_function_apply,
    pytree,
    set_graph_executor_optimize,
    set_tracing_state,
    set_version_counters,
    storage_address,
    storage_pointer,
    tensor_conversion,
    top_saved_tensor_hooks,
    unaliased,
    value_trace,
    version,
    view_base,
    watch_backward_nodes,
)
from ._calls import custom_op_gradients as custom_op_gradients
from ._calls import graph_kept as graph_kept
from ._fx_threads import fx_patches_per_thread
from ._inductor import _KEPT_ON_CPU as _KEPT_ON_CPU
from ._inductor import _Decompositions as _Decompositions
from ._inductor import _decompositions as _decompositions
from ._inductor import adopt_compile_settings as adopt_compile_settings
from ._inductor import (
    backend_exists,
    backward_compiled_with_forward,
    compile_captured,
    import_inductor,
    inductor_cache_dir,
    inductor_caches_on,
    mode_options,
    process_compile_settings,
)
from ._inductor import inductor_has_setting as inductor_has_setting
from ._private import ANY_AUTOCAST as ANY_AUTOCAST
from ._private import BACKWARD_HOOK_FUNCTION as BACKWARD_HOOK_FUNCTION
from ._private import COMPILE_FX as COMPILE_FX
from ._private import CURRENT_DISPATCH_MODE as CURRENT_DISPATCH_MODE
from ._private import DECOMPOSITIONS as DECOMPOSITIONS
from ._private import DISABLE_MODES as DISABLE_MODES
from ._private import DISABLED_TORCH_FUNCTION as DISABLED_TORCH_FUNCTION
from ._private import EAGER_FUNCTIONS as EAGER_FUNCTIONS
from ._private import ENGINE_RUN_BACKWARD as ENGINE_RUN_BACKWARD
from ._private import FAKE_MODE as FAKE_MODE
from ._private import FUNCTION_MODES as FUNCTION_MODES
from ._private import FUNCTORCH_CONFIG as FUNCTORCH_CONFIG
from ._private import FUNCTORCH_STACK as FUNCTORCH_STACK
from ._private import GLOBAL_HOOKS as GLOBAL_HOOKS
from ._private import GRAPH_EXECUTOR_OPTIMIZE as GRAPH_EXECUTOR_OPTIMIZE
from ._private import INDUCTOR as INDUCTOR
from ._private import INVALID_BACKEND as INVALID_BACKEND
from ._private import IS_FAKE as IS_FAKE
from ._private import KEEP_GRAPH as KEEP_GRAPH
from ._private import LIBRARY_DESTROY as LIBRARY_DESTROY
from ._private import LOOKUP_BACKEND as LOOKUP_BACKEND
from ._private import MODE_OPTIONS as MODE_OPTIONS
from ._private import NON_LAZY_BACKWARD as NON_LAZY_BACKWARD
from ._private import OP_OVERLOAD as OP_OVERLOAD
from ._private import PRESERVE_RNG as PRESERVE_RNG
from ._private import PRIVATE_APIS, PrivateAPI, missing_private_apis
from ._private import PROXY_TENSOR as PROXY_TENSOR
from ._private import PYTREE as PYTREE
from ._private import QUEUE_CALLBACK as QUEUE_CALLBACK
from ._private import SET_GRAD_ENABLED as SET_GRAD_ENABLED
from ._private import SET_GRAPH_EXECUTOR_OPTIMIZE as SET_GRAPH_EXECUTOR_OPTIMIZE
from ._private import SET_TRACING_STATE as SET_TRACING_STATE
from ._private import SHAPE_ENV as SHAPE_ENV
from ._private import TENSOR_BASE as TENSOR_BASE
from ._private import TENSOR_IS_VIEW as TENSOR_IS_VIEW
from ._private import TENSOR_VERSION as TENSOR_VERSION
from ._private import TORCH_C as TORCH_C
from ._private import TRACER_WARNING as TRACER_WARNING
from ._private import TRACING_STATE as TRACING_STATE
from ._private import VALUE_TRACE as VALUE_TRACE
from ._private import VERSION_COUNTER as VERSION_COUNTER
from ._version import TESTED_TORCH, TORCHSCRIPT_NOTICE, VALUE_OUT_OF_GRAPH

__all__ = [
    "backward_compiled_with_forward",
    "mode_options",
    "process_compile_settings",
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
    "top_saved_tensor_hooks",
    "function_mode_at",
    "function_modes",
    "value_trace",
    "graph_executor_optimize",
    "set_graph_executor_optimize",
    "set_version_counters",
    "is_fake",
    "grad_mode_setter",
    "disable_dispatch_modes",
    "backward_hook_function",
    "global_module_hooks",
    "MODULE_HOOK_DICTS",
    "tensor_conversion",
    "is_view",
    "storage_pointer",
    "view_base",
    "unaliased",
    "storage_address",
    "version",
    "destroy_library",
    "kept_though_unused",
    "backend_exists",
    "import_inductor",
    "inductor_cache_dir",
    "inductor_caches_on",
    "original_function_apply",
    "watch_backward_nodes",
    "fx_patches_per_thread",
    "compile_captured",
    "around_cpp_builds",
    "wrap_cpp_builds",
    "op_overload",
    "eager_functions",
    "pytree",
    "torchscript_available",
    "VALUE_OUT_OF_GRAPH",
]


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
