"""Stage 2 (trace): a custom function's own backward inside a gradient the step takes.

A custom function on the way of ``torch.autograd.grad`` inside the step is one opaque op of
the capture (:mod:`._custom_op`). Inside the vector-Jacobian product :mod:`._inner_grad`
traces, the op is called through :class:`OwnBackward`, whose gradient is the user's backward
run as Python (registered by :func:`own_backward`): traced, that backward is ordinary ops
which the training loss differentiates again, as eager's double backward does.

Where the gradient is differentiated again (``create_graph=True``, :func:`differentiated_again`),
a backward that runs ops with grad mode off is refused (:class:`~.errors.RunEagerly`): eager
takes what it computed under ``torch.no_grad()`` or ``@once_differentiable`` as constants, and
another custom function it applies by that function's own backward, while the traced ops would
be differentiated as they are. See NOTE [autograd inside the step] in docs/design.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from .errors import RunEagerly

__all__ = ["PYTHON_VJPS", "OwnBackward", "PythonVJP", "differentiated_again", "own_backward"]


class _Again(threading.local):
    create_graph = False
    """The gradient being traced will be differentiated again (``create_graph=True``)."""


_AGAIN = _Again()


@contextmanager
def differentiated_again(create_graph: bool) -> Iterator[None]:
    """While the block traces a gradient, whether it will be differentiated again."""
    previous, _AGAIN.create_graph = _AGAIN.create_graph, create_graph
    try:
        yield
    finally:
        _AGAIN.create_graph = previous


PythonVJP = Callable[
    [tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]],
    tuple[torch.Tensor | None, ...],
]
"""``(inputs, outputs, grad_outputs) -> input gradients``, made of differentiable ops."""

PYTHON_VJPS: dict[Any, PythonVJP] = {}
"""The ops of custom functions (:mod:`._custom_op`) whose gradient inside the step is their own
backward run as Python: traced, it is ops the training loss differentiates again, as eager's
double backward differentiates the ops the backward ran."""

_LABELS: dict[Any, str] = {}
"""The user's name of each op's custom function, for messages."""


def own_backward(op: Any, vjp: PythonVJP, label: str) -> Callable[[], None]:
    """Make a gradient through ``op`` (of the custom function ``label``) inside the step run
    ``vjp``; returns the undo."""
    PYTHON_VJPS[op], _LABELS[op] = vjp, label

    def undo() -> None:
        PYTHON_VJPS.pop(op, None)
        _LABELS.pop(op, None)

    return undo


_DATA = torch.Tensor.data


def _detaches(func: Any) -> bool:
    """``x.data`` or ``x.detach_()``: a constant for eager's double backward, which the traced
    ops do not show (``x.detach()`` they do)."""
    return getattr(func, "__self__", None) is _DATA or getattr(func, "__name__", "") == "detach_"


class _GradModeWatch(torch.overrides.TorchFunctionMode):
    """Notes the first torch function a custom backward runs with grad mode off.

    Eager double backward takes what a backward computed under ``torch.no_grad()`` (or
    ``set_grad_enabled(False)``, ``inference_mode``), all of a ``@once_differentiable``
    backward, and the forward of another custom function it applies (differentiated by that
    function's own backward) as other than the ops they ran, and so what it read through
    ``x.data`` or detached in place (``detach_``). The traced product sees only the ops, so a
    second derivative through them would differ: refused while ``create_graph``."""

    def __init__(self) -> None:
        super().__init__()
        self.first_off: Any = None

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        if self.first_off is None and (not torch.is_grad_enabled() or _detaches(func)):
            self.first_off = func
        return func(*args, **(kwargs or {}))


class OwnBackward(torch.autograd.Function):
    """An op of a custom function inside the traced vector-Jacobian product: its outputs are
    the op's, its gradient the function's own backward (functorch style: no ctx in forward)."""

    _phi_torch_jit_internal = True  # not a user's Function to record

    @staticmethod
    def forward(op: Any, vjp: PythonVJP, *inputs: torch.Tensor) -> Any:  # type: ignore[override]
        return op(*inputs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        op, vjp, *tensors = inputs
        outputs = output if isinstance(output, tuple) else (output,)
        ctx.op, ctx.vjp, ctx.n_inputs = op, vjp, len(tensors)
        ctx.save_for_backward(*tensors, *outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        saved = ctx.saved_tensors
        inputs, outputs = saved[: ctx.n_inputs], saved[ctx.n_inputs :]
        grads = tuple(
            torch.zeros_like(o) if g is None else g for g, o in zip(grad_outputs, outputs)
        )
        if not _AGAIN.create_graph:  # eager runs such a backward with grad mode off
            with torch.no_grad():
                return (None, None, *ctx.vjp(inputs, outputs, grads))
        with _GradModeWatch() as watch:
            gradients = ctx.vjp(inputs, outputs, grads)
        if watch.first_off is not None:
            name = getattr(watch.first_off, "__name__", str(watch.first_off))
            raise RunEagerly(
                f"it differentiates twice (create_graph=True) through the backward of custom "
                f"function {_LABELS.get(ctx.op, ctx.op)}, which runs {name} with grad mode off "
                "(torch.no_grad, @once_differentiable, another custom function's forward) or "
                "detaches through x.data or detach_(): "
                "a captured second derivative would differentiate those ops; compute them with "
                "grad mode on (.detach() for a constant), or differentiate outside the step"
            )
        return (None, None, *gradients)
