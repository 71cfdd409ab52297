"""Rewrites of a captured graph that keep inductor from computing something else than eager.

Each rewrite exists because of a measured inductor bug and is harmless where the bug is fixed
(it changes how a value is computed, never which value). The graph handed in is not changed:
callers serve it uncompiled meanwhile (engine "auto"'s fast tier), and there it must round
exactly as eager code does.

* **Scaled adds of a matrix product** (``acc.mul_(0.9).add_(a @ b, alpha=0.1)``, an EMA of
  codebook sums): inductor on the CPU fuses ``add(x, mm(a, b), alpha=s)`` into an ``addmm``
  and drops ``alpha`` -- it returns ``x + a @ b`` (torch 2.11 and 2.13; 2.15 is right). An
  ``add`` with ``alpha`` becomes ``add(x, mul(y, alpha))``, which it fuses correctly.
  ``tests/test_inductor_fixes.py`` shows the bug where the running torch has it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = ["for_inductor"]

_aten = torch.ops.aten
_SCALED = frozenset({_aten.add.Tensor, _aten.add_.Tensor})


def _scaled_adds(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [
        n
        for n in graph.nodes
        if n.op == "call_function" and n.target in _SCALED and n.kwargs.get("alpha", 1) != 1
    ]


def for_inductor(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``module``, or a copy of it with the rewrites above applied where they are needed."""
    if not _scaled_adds(module.graph):
        return module
    module = copy.deepcopy(module)
    graph = module.graph
    for node in _scaled_adds(graph):
        alpha: Any = node.kwargs["alpha"]
        other: Any = node.args[1]
        if isinstance(other, torch.fx.Node):
            with graph.inserting_before(node):
                scaled: Any = graph.call_function(_aten.mul.Tensor, (other, alpha))
        else:
            scaled = other * alpha
        node.args = (node.args[0], scaled, *node.args[2:])
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "alpha"}
    graph.lint()
    module.recompile()
    return module
