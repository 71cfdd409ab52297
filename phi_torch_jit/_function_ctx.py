"""What a captured ``torch.autograd.Function``'s forward leaves on ctx, and its backward
given that back.

:func:`run_forward` runs the Function's ``forward`` (and ``setup_context``) with a
:class:`FunctionContext` instead of torch's ctx, and returns the user's outputs followed by
the tensors the context holds -- saved tensors and tensor attributes that are neither inputs
nor outputs ("residuals") -- with a :class:`ContextLayout` saying where each piece of the
context came from (a :data:`Slot`: an input, an output, a residual or None) and which
non-tensor attributes it held. :func:`run_backward` rebuilds a context from the inputs,
outputs and residuals by that layout and calls ``backward``.

Both run plain Python, eagerly or under a trace, and know nothing of frames, phases or the
``Function.apply`` interception (that is :mod:`._function`, whose adapter calls them). A
context feature they cannot express -- ``mark_dirty``, ``save_for_forward``, non-tensor
outputs or non-tensors passed to ``save_for_backward`` -- raises :class:`Unsupported`, which
the caller turns into an eager run.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._libraries import backward_scope, custom_forward

__all__ = [
    "Unsupported",
    "Slot",
    "FunctionContext",
    "ContextLayout",
    "NeedsInputGrad",
    "forward_of",
    "has_setup_context",
    "run_forward",
    "run_backward",
]


class Unsupported(Exception):
    """A Function uses a feature the adapter cannot express."""


Slot = tuple[Any, ...]
"""Where a ctx tensor lives: ("none",), ("in", i), ("out", j) or ("res", r)."""


class FunctionContext:
    """Stands in for torch's ctx while a Function's forward or backward runs inside jit."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self._ptj_saved: tuple[torch.Tensor | None, ...] = ()
        self._ptj_non_differentiable: list[torch.Tensor] = []
        self._ptj_materialize = True

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None:
        self._ptj_saved = tensors

    @property
    def saved_tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self._ptj_saved

    saved_variables = saved_tensors

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        self._ptj_non_differentiable.extend(tensors)

    def set_materialize_grads(self, value: bool) -> None:
        self._ptj_materialize = value

    def mark_dirty(self, *tensors: torch.Tensor) -> None:
        raise Unsupported("it modifies inputs in place (ctx.mark_dirty)")

    def save_for_forward(self, *tensors: torch.Tensor | None) -> None:
        raise Unsupported("it saves tensors for forward-mode AD (ctx.save_for_forward)")

    def user_attributes(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_ptj_")}


@dataclass(frozen=True)
class ContextLayout:
    """What a Function's forward left on ctx, apart from the residual tensors themselves."""

    saved: tuple[Slot, ...]
    """One slot per ``save_for_backward`` entry."""
    tensor_attributes: tuple[tuple[str, Slot], ...]
    """ctx attributes holding tensors, with their slots."""
    static_attributes: tuple[tuple[str, Any], ...]
    """ctx attributes holding anything else (baked into compiled programs)."""
    non_differentiable: tuple[int, ...]
    """Indices of outputs marked non-differentiable."""
    n_outputs: int
    """Number of the Function's own outputs (residuals follow them)."""
    single: bool
    """Whether forward returned a bare tensor."""
    materialize: bool = True
    """``ctx.set_materialize_grads``: False gives the non-differentiable outputs' gradients to
    backward as None, as eager does."""


def _slot(t: Any, args: Sequence[Any], outs: Sequence[torch.Tensor], residuals: list[Any]) -> Slot:
    if t is None:
        return ("none",)
    if not isinstance(t, torch.Tensor):
        raise Unsupported(f"it saves a {type(t).__name__} with save_for_backward")
    for i, a in enumerate(args):
        if a is t:
            return ("in", i)
    for j, o in enumerate(outs):
        if o is t:
            return ("out", j)
    residuals.append(t)
    return ("res", len(residuals) - 1)


_FORWARDS: weakref.WeakKeyDictionary[type, Any] = weakref.WeakKeyDictionary()


def forward_of(cls: Any) -> Any:
    """``cls.forward``, or the forward a library gives its classes (PhiML's wrapped function
    for its custom gradients, NOTE [PhiML bridge]: PhiML's own forward returns stale outputs
    under a trace). Found once per class."""
    forward = _FORWARDS.get(cls)
    if forward is None:
        forward = _FORWARDS[cls] = custom_forward(cls) or cls.forward
    return forward


class NeedsInputGrad(tuple):  # type: ignore[type-arg]
    """``ctx.needs_input_grad`` of one ``apply``, as eager autograd computes it (an input that
    requires grad, in grad mode), passed to the captured forward as a last static argument:
    a forward that branches on it (or refuses a pattern) is compiled per pattern."""

    @classmethod
    def of(cls, args: Sequence[Any]) -> NeedsInputGrad:
        grad = torch.is_grad_enabled()
        return cls(grad and isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def has_setup_context(cls: type) -> bool:
    return cls.setup_context is not torch.autograd.Function.setup_context  # type: ignore[attr-defined]


def run_forward(
    cls: Any, args: tuple[Any, ...], needs: tuple[bool, ...], source: Any = None
) -> tuple[tuple[torch.Tensor, ...], ContextLayout]:
    """Run ``cls.forward`` (or ``source`` in its place) with a :class:`FunctionContext` whose
    ``needs_input_grad`` is ``needs``; return (outputs + residuals, layout)."""
    ctx = FunctionContext(tuple(needs))
    with torch.no_grad():
        if has_setup_context(cls):
            out = (source or cls.forward)(*args)
            cls.setup_context(ctx, args, out)
        else:
            out = (source or forward_of(cls))(ctx, *args)
    single = isinstance(out, torch.Tensor)
    outs = (out,) if single else tuple(out) if isinstance(out, (tuple, list)) else None
    if not outs or not all(isinstance(o, torch.Tensor) for o in outs):
        raise Unsupported("its forward returns non-tensor values")
    residuals: list[torch.Tensor] = []
    saved = tuple(_slot(t, args, outs, residuals) for t in ctx.saved_tensors)
    tensor_attrs, static_attrs = [], []
    for name, value in ctx.user_attributes().items():
        if name == "needs_input_grad":
            continue
        if isinstance(value, torch.Tensor):
            tensor_attrs.append((name, _slot(value, args, outs, residuals)))
        else:
            static_attrs.append((name, value))
    if any(r.grad_fn is not None for r in residuals):
        raise Unsupported(
            "its forward builds an autograd graph (under enable_grad) that it keeps for its "
            "backward; a compiled op's outputs carry no graph"
        )
    marked = {id(t) for t in ctx._ptj_non_differentiable}
    differentiable = [o for o in outs if id(o) not in marked and o.dtype.is_floating_point]
    if not ctx._ptj_materialize and len(differentiable) > 1:
        raise Unsupported(
            "it calls ctx.set_materialize_grads(False) and has several differentiable outputs: "
            "eager gives backward None for an output that got no gradient, a compiled backward "
            "zeros"
        )
    layout = ContextLayout(
        saved=saved,
        tensor_attributes=tuple(tensor_attrs),
        static_attributes=tuple(static_attrs),
        non_differentiable=tuple(j for j, o in enumerate(outs) if id(o) in marked),
        n_outputs=len(outs),
        single=single,
        materialize=ctx._ptj_materialize,
    )
    return (*outs, *residuals), layout


def run_backward(
    cls: Any,
    layout: ContextLayout,
    inputs: tuple[Any, ...],
    outputs: tuple[torch.Tensor, ...],
    grad_outputs: tuple[torch.Tensor, ...],
    needs_input_grad: tuple[bool, ...],
    source: Any = None,
) -> tuple[Any, ...]:
    """Rebuild ctx from ``layout`` and call ``cls.backward`` (or ``source`` in its place);
    trailing extra Nones are dropped."""
    own, residuals = outputs[: layout.n_outputs], outputs[layout.n_outputs :]

    def resolve(slot: Slot) -> torch.Tensor | None:
        kind = slot[0]
        if kind == "none":
            return None
        return {"in": inputs, "out": own, "res": residuals}[kind][slot[1]]  # type: ignore[no-any-return]

    ctx = FunctionContext(needs_input_grad)
    ctx.save_for_backward(*(resolve(s) for s in layout.saved))
    for name, slot in layout.tensor_attributes:
        setattr(ctx, name, resolve(slot))
    for name, value in layout.static_attributes:
        setattr(ctx, name, value)
    given: list[torch.Tensor | None] = list(grad_outputs[: layout.n_outputs])
    if not layout.materialize:
        for j in layout.non_differentiable:
            given[j] = None
    with backward_scope(cls):  # a library's (PhiML's adjoint solve: no TorchScript on our path)
        result = (source or cls.backward)(ctx, *given)
    grads = tuple(result) if isinstance(result, (tuple, list)) else (result,)
    while len(grads) > len(inputs) and grads[-1] is None:
        grads = grads[:-1]
    return grads
