"""Small functions that call the private APIs of :mod:`._private`, for the rest of the
package: the C functions read on every jitted call, bound at import (looked up at the first
call instead where this torch lacks one), and accessors of torch's hooks, classes and
modules."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import TorchVersionError
from ._private import (
    ANY_AUTOCAST,
    BACKWARD_HOOK_FUNCTION,
    BACKWARD_NODE,
    DISABLE_MODES,
    EAGER_FUNCTIONS,
    FUNCTION_MODE_AT,
    FUNCTION_MODES,
    FUNCTORCH_STACK,
    GLOBAL_HOOKS,
    GRAPH_EXECUTOR_OPTIMIZE,
    IS_FAKE,
    KEEP_GRAPH,
    LIBRARY_DESTROY,
    OP_OVERLOAD,
    PYTREE,
    SAVED_TENSOR_HOOKS,
    SET_GRAD_ENABLED,
    SET_GRAPH_EXECUTOR_OPTIMIZE,
    SET_TRACING_STATE,
    SIDE_EFFECTFUL,
    TENSOR_BASE,
    TRACER_WARNING,
    TRACING_STATE,
    VALUE_TRACE,
    VERSION_COUNTER,
    PrivateAPI,
)


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
top_saved_tensor_hooks: Callable[[bool], Any] = _now_or_lazy(SAVED_TENSOR_HOOKS)
"""The innermost saved-tensor hooks (``saved_tensors_hooks``, ``save_on_cpu``) active on this
thread, None when none are (``top_saved_tensor_hooks(False)``, read on every jitted call)."""
function_modes: Callable[[], int] = _now_or_lazy(FUNCTION_MODES)
"""How many torch-function modes are active (0: factories make tensors on the CPU)."""
function_mode_at: Callable[[int], Any] = _Lazy(FUNCTION_MODE_AT)
"""The torch-function mode at a depth of this thread's stack (0: the outermost)."""
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


def grad_mode_setter() -> tuple[Any, str]:
    """(module, attribute) of torch's C function that every grad-mode change calls, so the
    record pass can watch it."""
    SET_GRAD_ENABLED.find()
    return importlib.import_module("torch._C"), "_set_grad_enabled"


def backward_hook_function() -> type:
    """The autograd.Function class torch uses to fire module backward hooks."""
    return BACKWARD_HOOK_FUNCTION.find()  # type: ignore[no-any-return]


def watch_backward_nodes(note: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``note(function_class)`` each time a custom Function's backward node is built (on
    every ``apply``, whatever name it was called under), on any thread; returns the undo."""
    base = BACKWARD_NODE.find()
    own = base.__dict__.get("__init__")

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        note(getattr(type(self), "_forward_cls", None))
        if own is not None:
            own(self, *args, **kwargs)
        else:
            super(base, self).__init__(*args, **kwargs)

    base.__init__ = init

    def undo() -> None:
        if own is None:
            del base.__init__
        else:
            base.__init__ = own

    return undo


MODULE_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks",
                     "_backward_hooks")  # fmt: skip
"""The attributes of an ``nn.Module`` holding its hooks, in the order of
:func:`global_module_hooks`."""


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


def storage_pointer(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s storage (tensors sharing memory share it); 0 for a tensor
    without storage (sparse, functional wrappers, uninitialized) or an empty one."""
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, ValueError):  # ValueError: a lazy module's
        return 0  # parameter, not initialized yet


def is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of another tensor."""
    return bool(tensor._is_view())


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``tensor`` is a view of (None if it is no view)."""
    return tensor._base if tensor._is_view() else None


def unaliased(results: Sequence[Any], arguments: Sequence[torch.Tensor]) -> list[Any]:
    """``results`` with a copy of each that is a view, an argument, or shares memory with an
    argument or an earlier result: a custom op's outputs may alias nothing. torch checks it
    when a compiled program runs: an error where the environment variable ``CI`` is set (a
    PhiFlow step's inductor program failed there and its fast tier served), a warning
    elsewhere, "deprecated and will become an error"."""
    taken = {storage_address(a) for a in arguments} - {None}
    kept: list[Any] = []
    for tensor in results:
        if isinstance(tensor, torch.Tensor):
            memory = storage_address(tensor)
            if is_view(tensor) or memory in taken or any(tensor is a for a in arguments):
                tensor = tensor.clone()
                memory = storage_address(tensor)
            if memory is not None:
                taken.add(memory)
        kept.append(tensor)
    return kept


def storage_address(tensor: torch.Tensor) -> int | None:
    """Where the tensor's storage lives (None: no storage, or an empty one, as for fake,
    functional and sparse tensors)."""
    try:
        return tensor.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError, TypeError):  # fake, functional, sparse
        return None


def version(tensor: torch.Tensor) -> int:
    """The tensor's version counter (advanced by every in-place write)."""
    return int(tensor._version)


def destroy_library(library: Any) -> Callable[[], None]:
    """A callable that removes ``library``'s operators from torch's registry."""
    return LIBRARY_DESTROY.find().__get__(library)  # type: ignore[no-any-return]


def kept_though_unused(op: Any) -> Callable[[], None]:
    """Mark ``op`` (an OpOverload) as having side effects, so that no dead-code elimination
    (FX's, AOTAutograd's, inductor's) drops a call whose outputs are unused; returns the
    callable that unmarks it."""
    marked: set[Any] = SIDE_EFFECTFUL.find()
    marked.add(op)
    return lambda: marked.discard(op)


def original_function_apply(descriptor: Any) -> Callable[..., Any]:
    """``(cls, *args) -> cls.apply(*args)`` for the descriptor found in
    ``torch.autograd.Function.__dict__["apply"]``.

    torch 2.13 defines ``apply`` as a Python classmethod (with ``__func__``); 2.15 as a C-level
    ``classmethod_descriptor`` (without). Binding through ``__get__`` works for both.
    """

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        return descriptor.__get__(None, cls)(*args, **kwargs)

    return apply


def graph_kept() -> bool:
    """Whether the backward running on this thread keeps its graph (``retain_graph``)."""
    return bool(KEEP_GRAPH.find()())


def op_overload() -> Any:
    """The class of the ops in captured graphs (``torch.ops.aten.add.Tensor``...)."""
    return OP_OVERLOAD.find()  # type: ignore[no-any-return]


def pytree() -> Any:
    """torch's pytree module (``tree_flatten``, ``tree_unflatten``, ``SUPPORTED_NODES``)."""
    return PYTREE.find()


def eager_functions() -> Any:
    """The namespace of C functions behind ``torch.<op>``."""
    return EAGER_FUNCTIONS.find()


def custom_op_gradients() -> list[Any] | None:
    """The gradient formulas (``register_autograd``) of the ops made with
    ``torch.library.custom_op`` so far (None where a torch has no such registry)."""
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:
        return None
    return [getattr(op, "_backward_fn", None) for op in list(OPDEFS.values())]
