"""Compiled programs whose gradients can be differentiated again (engines "compile", "auto").

AOTAutograd's compiled backward cannot be differentiated: ``autograd.grad(y, x,
create_graph=True)`` through it gives gradients whose own backward raises ("does not
currently support double backward"), so a PINN residual, a gradient penalty or a force as
the gradient of an energy, taken outside a jitted model, crashed on these engines.

:class:`TwiceDifferentiable` runs the compiled program inside one autograd node of its own
(NOTE [double backward] in docs/design.md):

- the forward runs the compiled program on detached aliases of the inputs, with grad on, and
  keeps its autograd graph;
- a plain backward (``create_graph=False``, every training step) runs the compiled backward
  through that graph: one ``autograd.grad`` call more than before, nothing recomputed;
- a backward with ``create_graph=True`` runs the captured graph (eager aten ops, the same
  ops the backend compiled) on the saved inputs and differentiates it with autograd, so the
  gradients are differentiable as eager code's are: that backward costs a forward more.

The compiled backward runs with the ``retain_graph`` of the backward that reaches it, so
donated buffers (AOTAutograd's memory reuse) stay as they were.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._compat import graph_kept

__all__ = ["TwiceDifferentiable", "needs_twice"]


def needs_twice(grad_enabled: bool, requires_grad: list[bool]) -> bool:
    """Whether a program compiled in this grad mode, for arguments (not parameters) that
    require grad like this, is kept differentiable twice.

    Gradients with ``create_graph=True`` are taken with respect to arguments (a PINN's
    coordinates, positions for forces, a gradient penalty's samples); a training step's
    arguments do not require grad, and its program runs without this node (which costs one
    nested backward, about 0.15 ms per step on this machine's small MLP)."""
    return grad_enabled and any(requires_grad)


class TwiceDifferentiable:
    """A compiled program (flat tensors in, a tuple of tensors out) whose gradients can be
    differentiated again; ``graph``: the captured graph it was compiled from."""

    def __init__(self, compiled: Callable[..., Any], graph: Callable[..., Any]) -> None:
        self.compiled = compiled
        self.graph = graph

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if not torch.is_grad_enabled():
            return self.compiled(*inputs)
        return _Node.apply(self, *inputs)


class _Node(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, program: TwiceDifferentiable, *inputs: torch.Tensor) -> Any:
        aliases = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        with torch.enable_grad():
            outputs = tuple(program.compiled(*aliases))
        ctx.program = program
        ctx.aliases = aliases
        ctx.outputs = outputs
        ctx.save_for_backward(*inputs)
        ctx.set_materialize_grads(False)
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        wanted = [i for i, t in enumerate(ctx.aliases) if t.requires_grad]
        used = [j for j, (o, g) in enumerate(zip(ctx.outputs, grads)) if g is not None
                and o.requires_grad]  # fmt: skip
        result: list[torch.Tensor | None] = [None] * len(ctx.aliases)
        if not wanted or not used:
            return (None, *result)
        if torch.is_grad_enabled():  # create_graph=True: gradients differentiable again
            inputs = ctx.saved_tensors
            outputs = ctx.program.graph(*inputs)
            found = torch.autograd.grad(
                [outputs[j] for j in used], [inputs[i] for i in wanted],
                [grads[j] for j in used], create_graph=True, allow_unused=True,
            )  # fmt: skip
        else:  # the compiled backward, retaining its graph as the running backward does
            found = torch.autograd.grad(
                [ctx.outputs[j] for j in used], [ctx.aliases[i] for i in wanted],
                [grads[j] for j in used], retain_graph=graph_kept(), allow_unused=True,
            )  # fmt: skip
        for i, g in zip(wanted, found):
            result[i] = g
        return (None, *result)
