"""Plain ``torch.autograd.Function`` subclasses inside jit, unchanged.

While a jitted call is specialized, ``Function.apply`` -- a classmethod on torch's base
class -- is replaced by :func:`_apply` (:func:`function_capture`, entered by every phase, see
:mod:`._phases`). Calls made inside a frame go to :func:`dispatch`; every other call (other
threads, eager code) goes to the original unchanged. The replacement is reference counted
across threads and removed when the last frame closes, so code outside jit never sees it (and
torch.compile, which recognizes ``Function.apply``, is not disturbed).

Each call of a user Function goes through a
:class:`FunctionAdapter`: a custom function (see :mod:`._custom`) whose

* forward runs the Function's ``forward`` with a stand-in ctx and returns its
  outputs followed by the tensors the ctx holds ("residuals");
* gradient rebuilds a ctx from the inputs, outputs and residuals and calls
  ``backward`` (both in :mod:`._function_ctx`, which says how).

So a Function gets everything a custom function gets: recorded once,
forward compiled once, backward compiled lazily per needs-input-grad
pattern, None gradients filtered, no double execution, no baked loops.

A class defined inside the step (a new one on every call) that closes over tensors passes
them as further inputs (:mod:`._function_closures`).

What cannot be expressed that way makes the whole specialization run
eagerly, with one log line saying why (never a wrong result): ``mark_dirty``
(in-place outputs), ``save_for_forward``, non-tensor outputs, torch's own
internal Functions other than the reentrant checkpoint (which compiled
programs inline: same values, no recomputation), and a forward that must run
as Python while storing non-tensor values on ctx (those could differ from
call to call). See NOTE [autograd.Function capture] in docs/design.md.
"""

from __future__ import annotations

import inspect
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointFunction

from ._compat import (
    backward_hook_function,
    functorch_transform,
    original_function_apply,
    watch_backward_nodes,
)
from ._context import CustomCallee, Phase, current_frame
from ._custom import CustomFunction, untraced
from ._function_closures import ClosurePlan, plan_closures, plan_library_closures
from ._function_ctx import (
    ContextLayout,
    FunctionContext,
    NeedsInputGrad,
    Unsupported,
    forward_of,
    has_setup_context,
    run_backward,
    run_forward,
)
from ._libraries import closure_roots, custom_forward
from ._patches import RefCounted
from ._sources import is_user_file
from ._warnings import torchscript_notices_hidden
from .errors import RunEagerly, describe_function

__all__ = [
    "FunctionContext",
    "ContextLayout",
    "FunctionAdapter",
    "dispatch",
    "function_capture",
    "original_apply",
    "interception_installed",
]

logger = logging.getLogger("phi_torch_jit")

_FUNCTION = torch.autograd.Function
_ORIGINAL = _FUNCTION.__dict__["apply"]  # a classmethod (torch 2.13) or its C twin (2.15)
_original_apply = original_function_apply(_ORIGINAL)


class _Expected(threading.local):
    cls: Any = None
    """The Function class :func:`original_apply` is applying (its backward node is ours)."""


_EXPECTED = _Expected()


def original_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``cls.apply(*args)`` as torch defines it, bypassing the interception."""
    previous, _EXPECTED.cls = _EXPECTED.cls, cls
    try:
        return _original_apply(cls, *args, **kwargs)
    finally:
        _EXPECTED.cls = previous


def _node_built(cls: Any) -> None:
    """A backward node of ``cls`` was built: an apply that bypassed :func:`dispatch` (``op =
    F.apply`` bound before the interception, in the user's module or a library's) makes the
    specialization run eagerly: traced, its forward's ops would be differentiated, not its
    backward."""
    if cls is None or cls is _EXPECTED.cls:
        _EXPECTED.cls = None
        return
    if _passes_through(cls) or cls.__module__.startswith("torch.") or not torch.is_grad_enabled():
        return  # grad mode off: no backward through it (the key holds the grad mode)
    frame = current_frame()
    if frame is None or frame.phase is not Phase.RECORD or frame.recording is None:
        return
    reason = (
        f"it applies autograd.Function {cls.__qualname__} through a name bound before the "
        f"call ({cls.__qualname__}.apply held as a global, attribute or default, e.g. "
        "op = F.apply at import), which jit cannot intercept: a compiled program would "
        f"differentiate its forward's ops, not its backward; call {cls.__qualname__}.apply(...) "
        "inside the step"
    )
    if reason not in frame.recording.eager_reasons:
        frame.recording.eager_reasons.append(reason)


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    return dispatch(cls, args, kwargs)


_META = type(_FUNCTION)
_META_INIT = _META.__dict__["__init__"]


def _noting_creation(cls: type, *args: Any, **kwargs: Any) -> None:
    """``FunctionMeta.__init__``, noting each class made inside a pass in its frame."""
    _META_INIT(cls, *args, **kwargs)
    frame = current_frame()
    if frame is not None:
        frame.new_functions.add(cls)


_UNDO: list[Callable[[], None]] = []


def _install() -> None:
    _FUNCTION.apply = classmethod(_apply)  # type: ignore[assignment,method-assign]
    _META.__init__ = _noting_creation  # type: ignore[method-assign]
    _UNDO.append(watch_backward_nodes(_node_built))


def _remove() -> None:
    _FUNCTION.apply = _ORIGINAL  # type: ignore[method-assign]
    _META.__init__ = _META_INIT  # type: ignore[method-assign]
    _UNDO.pop()()


_CAPTURE = RefCounted(_install, _remove)


def function_capture() -> Any:
    """Context manager: intercept ``Function.apply`` while the block runs (reference counted)."""
    return _CAPTURE.active()


def interception_installed() -> bool:
    """Whether ``Function.apply`` is replaced now (some thread is inside a jit frame)."""
    return _FUNCTION.__dict__["apply"] is not _ORIGINAL


def _needs_grad(args: Sequence[Any]) -> tuple[bool, ...]:
    """A backward's needs_input_grad when autograd gives none: every differentiable tensor."""
    return tuple(
        isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex()) for a in args
    )


class _AdapterFunction(CustomFunction):
    """The custom function standing for one Function subclass."""

    def __init__(self, adapter: FunctionAdapter) -> None:
        # The gradient goes through _call_gradient, which also passes needs_input_grad.
        super().__init__(adapter.forward, adapter.gradient, name=adapter.cls.__name__)  # type: ignore[arg-type]
        self.label = describe_function(adapter.cls)
        self.scriptable = None  # the forward takes a ctx: never scriptable
        forward = getattr(getattr(adapter.cls, "forward", None), "__code__", None)
        self.user_code = forward is None or is_user_file(forward.co_filename)
        self.adapter = adapter

    def _call_gradient(
        self,
        inputs: tuple[Any, ...],
        outputs: tuple[torch.Tensor, ...],
        grad_outputs: tuple[torch.Tensor, ...],
        needs_input_grad: tuple[bool, ...] | None,
        context: Any,
        source: Callable[..., Any] | None = None,
    ) -> Any:
        pattern = needs_input_grad if needs_input_grad is not None else _needs_grad(inputs)
        return self.adapter.gradient(inputs, outputs, grad_outputs, pattern, context, source)

    def _forward(self, args: tuple[Any, ...], source: Any = None) -> tuple[Any, Any]:
        return self.adapter.forward(*args, source=source)

    @property
    def gradient_source(self) -> Callable[..., Any]:
        """``backward``, called with a rebuilt ctx and the output gradients."""
        return self.adapter.cls.backward  # type: ignore[attr-defined,no-any-return]

    @property
    def loop_source(self) -> Callable[..., Any]:
        """``forward`` (with its ctx argument unless the class has ``setup_context``)."""
        cls = self.adapter.cls
        forward = cls.forward if has_setup_context(cls) else forward_of(cls)  # type: ignore[attr-defined]
        return forward  # type: ignore[no-any-return]

    def matches(self, other: CustomCallee) -> bool:
        """Same Function code, even if a factory made a new class for the trace pass (PhiML
        does): the recorded class is the one compiled and run."""
        if other is self:
            return True
        if not isinstance(other, _AdapterFunction):
            return False
        mine, theirs = self.adapter.cls, other.adapter.cls
        return (
            all(
                getattr(mine, name).__code__ is getattr(theirs, name).__code__
                for name in ("forward", "backward")
                if hasattr(getattr(mine, name), "__code__")
            )
            and mine.__qualname__ == theirs.__qualname__
        )


def _layout_key(args: Sequence[Any]) -> Any:
    with untraced():  # under a trace, shapes would be traced values
        return _signature_of(args)


def _signature_of(args: Sequence[Any]) -> Any:
    key = tuple(
        (tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else (type(a), a)
        for a in args
    )
    try:
        hash(key)
    except TypeError:
        return None  # unhashable static arguments share one entry
    return key


class FunctionAdapter:
    """Makes one ``torch.autograd.Function`` subclass behave as a custom function inside jit."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.layouts: dict[Any, ContextLayout] = {}
        """Layout per call signature, from the latest forward run."""
        self.custom = _AdapterFunction(self)
        self.closure = ClosurePlan(())
        """Where the tensors its class closes over sit (a class defined per call): passed
        after the arguments, swapped into this class's closures while it runs."""

    def forward(
        self, *args: Any, source: Callable[..., Any] | None = None
    ) -> tuple[tuple[torch.Tensor, ...], ContextLayout]:
        """Run the Function's forward: (outputs + residuals, the ctx layout as call context).

        ``args`` end with the call's :class:`NeedsInputGrad`; ``source`` replaces the forward
        function (its loops captured)."""
        *inputs, needs = args
        own, closed = _split(inputs, len(self.closure))
        # PhiML scripts inside its forwards: NOTE [TorchScript notices].
        with torchscript_notices_hidden(), self.closure.swapped(self.cls, closed):
            outputs, layout = run_forward(self.cls, own, needs, source)
        self.layouts[_layout_key(args)] = layout
        return outputs, layout

    def gradient(
        self,
        inputs: tuple[Any, ...],
        outputs: tuple[torch.Tensor, ...],
        grad_outputs: tuple[torch.Tensor, ...],
        needs_input_grad: tuple[bool, ...],
        context: ContextLayout | None = None,
        source: Callable[..., Any] | None = None,
    ) -> tuple[Any, ...]:
        """``source``: runs in place of ``backward`` (its loops captured)."""
        layout = context if context is not None else self.layouts[_layout_key(inputs)]
        own, closed = _split(inputs[:-1], len(self.closure))  # last: the pattern
        needs = tuple(needs_input_grad)[: len(own)]
        with torchscript_notices_hidden(), self.closure.swapped(self.cls, closed):
            grads = run_backward(self.cls, layout, own, outputs, grad_outputs, needs, source)
        return (*grads, *(None,) * (len(inputs) - len(grads)))

    def __call__(self, *args: Any) -> Any:
        # the phase switch of every custom function; closed-over tensors are inputs too, with
        # no gradient (eager autograd gives them none through the Function)
        closed = self.closure.tensors_of(self.cls)
        outputs, layout = self.custom.call((*args, *closed, NeedsInputGrad.of(args)))
        own = outputs[: layout.n_outputs]
        if layout.non_differentiable:
            own = tuple(
                o.detach() if j in layout.non_differentiable else o for j, o in enumerate(own)
            )
        return own[0] if layout.single else tuple(own)


def _split(inputs: Sequence[Any], n_closed: int) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(the call's own arguments, the closed-over tensors after them)."""
    cut = len(inputs) - n_closed
    return tuple(inputs[:cut]), tuple(inputs[cut:])


_ADAPTERS: weakref.WeakKeyDictionary[type, FunctionAdapter] = weakref.WeakKeyDictionary()
_INLINED_LOGGED: set[str] = set()


def _adapter(cls: type) -> FunctionAdapter:
    adapter = _ADAPTERS.get(cls)
    if adapter is None:
        adapter = _ADAPTERS[cls] = FunctionAdapter(cls)
    return adapter


def _positional(cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    if not kwargs:
        return args
    try:
        signature = inspect.signature(cls.forward)
        params = list(signature.parameters.values())
        if not has_setup_context(cls):
            signature = signature.replace(parameters=params[1:])  # drop ctx
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    return tuple(bound.arguments.values())


_BACKWARD_HOOK_FUNCTION = backward_hook_function()


# torch's own Functions that are not captured: the autograd of custom ops (ours included)
# and the backward-hook machinery (a module with backward hooks runs eagerly anyway).
def _passes_through(cls: Any) -> bool:
    return (
        getattr(cls, "_phi_torch_jit_internal", False)
        or cls.__module__.startswith("torch._library.")
        or cls is _BACKWARD_HOOK_FUNCTION
    )


def dispatch(cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``cls.apply(*args, **kwargs)`` while ``Function.apply`` is intercepted."""
    frame = current_frame()
    if frame is None or _passes_through(cls):
        return original_apply(cls, *args, **kwargs)
    if cls is CheckpointFunction:
        return _checkpoint(frame.phase, args)
    positional = _positional(cls, args, kwargs)
    reason = ""
    plan = _closures_of(cls, frame)
    if plan is None:
        return original_apply(cls, *args, **kwargs)  # the specialization runs eagerly
    if cls.__module__.startswith("torch."):
        reason = f"it calls torch's internal autograd.Function {cls.__qualname__}"
    elif functorch_transform() is not None:  # our stand-in has no setup_context, no vmap rule
        reason = (
            f"it applies autograd.Function {cls.__qualname__} inside a torch.func transform "
            "(vmap, grad), which the capture does not follow"
        )
    elif positional is None:
        reason = f"the arguments of {cls.__qualname__}.apply cannot be bound to its forward"
    if not reason:
        adapter = _adapter(cls)
        if len(plan):
            adapter.closure = plan
        kept = _dirtied_inputs(cls, positional or ())
        try:
            return adapter(*positional)  # type: ignore[misc]
        except Unsupported as error:
            reason = f"autograd.Function {adapter.custom.label} cannot be compiled: {error}"
            with torch.no_grad():  # its forward wrote them before ctx.mark_dirty said so:
                for tensor, value in kept:  # torch's apply below writes them (once)
                    tensor.copy_(value)
    return _run_eagerly(frame.phase, reason, cls, args, kwargs)


def _dirtied_inputs(cls: Any, args: Sequence[Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of the tensor arguments of a Function whose forward calls ``ctx.mark_dirty``
    (it writes them, then the capture refuses it: ``_function_ctx``); none for others."""
    code = getattr(getattr(cls.forward, "__func__", cls.forward), "__code__", None)
    if code is None or "mark_dirty" not in code.co_names:
        return []
    return [(a, a.detach().clone()) for a in args if isinstance(a, torch.Tensor)]


def _closures_of(cls: Any, frame: Any) -> ClosurePlan | None:
    """The closed-over tensors of a class made in this pass (a class defined inside the step:
    ``op = Op(a)`` closed over, a new class on every call), which become inputs of its custom
    function; none for other classes. None where they cannot be replaced: noted as
    unguardable in the record pass (the specialization runs eagerly, warned)."""
    if cls not in frame.new_functions:
        return ClosurePlan(())
    if custom_forward(cls) is not None:  # a library's class: where its values sit, its word
        roots = closure_roots(cls)
        plan = plan_library_closures(cls, roots) if roots else ClosurePlan(())
    else:
        plan = plan_closures(cls)
    if frame.phase is Phase.COMPILE and (isinstance(plan, str) or len(plan)):
        # made inside a custom function's forward being compiled, closing over its traced
        # values: that forward runs as Python instead
        raise RunEagerly(f"{describe_function(cls.forward)} closes over tensors of the call")
    if isinstance(plan, ClosurePlan):
        return plan
    if frame.phase is Phase.RECORD:
        seen = frame.recording.unguardable
        label = f"{describe_function(cls.forward)} closing over {plan}"
        if label not in seen.per_call_functions:
            seen.per_call_functions.append(label)
    return None


def _run_eagerly(phase: Phase, reason: str, cls: Any, args: Any, kwargs: Any) -> Any:
    if phase is Phase.RECORD:
        frame = current_frame()
        assert frame is not None and frame.recording is not None
        frame.recording.eager_reasons.append(reason)
        return original_apply(cls, *args, **kwargs)
    raise RunEagerly(reason)  # compile phase: the enclosing compile falls back to Python


def _checkpoint(phase: Phase, args: tuple[Any, ...]) -> Any:
    """Reentrant checkpoint: eager in the record pass, inlined when compiled."""
    run_function, _preserve_rng, *inputs = args
    if phase is Phase.RECORD:
        return original_apply(CheckpointFunction, *args)
    label = describe_function(run_function)
    if label not in _INLINED_LOGGED:
        _INLINED_LOGGED.add(label)
        logger.info(
            "phi_torch_jit: torch.utils.checkpoint of %s is inlined in the compiled program "
            "(same values, no recomputation in backward)",
            label,
        )
    return run_function(*inputs)
