"""Loop capture, step 3's trace: a block's graph built from one traced iteration.

A block of ``K`` predicated iterations (:mod:`._block`) was traced by running the iteration
function ``K`` times under ``make_fx``: every op dispatched ``K`` times through the tracer, most
of the first call of a step whose custom function holds a CG (PhiFlow's pressure solve: 4
iterations of a dozen ops, about 0.2 s of a 1.3 s first call). Here the iteration is traced
once, the block's exit check once, and the block's graph is those graphs' nodes copied: ``K``
copies of the iteration, each fed the one before, then the exit check. No op runs again.

That is the same graph only where one iteration's outputs look like its inputs (the carried
values keep their shape, dtype, device and strides, and ``go`` stays a 0-d bool): copies of
the first iteration's nodes carry the first iteration's metadata, which later iterations
would otherwise recompute. Where they do not, or where a graph is not plain (an attribute
path with dots), :func:`composed` returns None and the caller traces the ``K`` iterations.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from .._fast_capture import fast_metadata

__all__ = ["composed"]


def composed(
    one: Callable[..., tuple[torch.Tensor, ...]],
    last: Callable[..., tuple[torch.Tensor, ...]],
    inputs: Sequence[torch.Tensor],
    n_carried: int,
    size: int,
) -> torch.fx.GraphModule | None:
    """The graph of ``last(one(...(one(go, *carried), ...), *invariants))`` with ``size`` calls
    of ``one``, for ``inputs = (go, *carried, *invariant tensors)``; ``one`` returns ``(go,
    *carried)``, ``last`` the block's outputs. None where a copy would not be faithful."""
    with torch.no_grad(), fast_metadata():
        iteration = make_fx(one)(*inputs)
        if not _keeps_its_inputs_look(iteration, 1 + n_carried):
            return None
        exit_check = make_fx(last)(*inputs)
    root = torch.nn.Module()
    if not (
        _own_constants(iteration, root, "iteration") and _own_constants(exit_check, root, "exit")
    ):
        return None
    graph = torch.fx.Graph()
    placeholders = [
        _placeholder_like(graph, node) for node in iteration.graph.nodes if node.op == "placeholder"
    ]
    current = list(placeholders)
    for _ in range(size):
        outputs = _copy_into(graph, iteration, current)
        current = [*outputs, *placeholders[1 + n_carried :]]
    graph.output(_copy_into(graph, exit_check, current, flat=False))
    graph._codegen = copy.deepcopy(exit_check.graph._codegen)  # flat inputs, the block's outputs
    return torch.fx.GraphModule(root, graph)


def _placeholder_like(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    placeholder = graph.placeholder(node.name)
    placeholder.meta = dict(node.meta)
    return placeholder


def _copy_into(
    graph: torch.fx.Graph,
    source: torch.fx.GraphModule,
    inputs: list[torch.fx.Node],
    flat: bool = True,
) -> Any:
    """Copy ``source``'s nodes into ``graph`` with its placeholders bound to ``inputs``; the
    mapped output (a list of nodes if ``flat``)."""
    placeholders = [node for node in source.graph.nodes if node.op == "placeholder"]
    bound: dict[torch.fx.Node, torch.fx.Node] = dict(zip(placeholders, inputs, strict=True))
    result: Any = graph.graph_copy(source.graph, bound)
    return list(result) if flat else result


def _keeps_its_inputs_look(iteration: torch.fx.GraphModule, n_outputs: int) -> bool:
    """Whether each of the first ``n_outputs`` outputs has its input's metadata."""
    placeholders = [node for node in iteration.graph.nodes if node.op == "placeholder"]
    (output,) = [node for node in iteration.graph.nodes if node.op == "output"]
    results = output.args[0]
    if not isinstance(results, (tuple, list)) or len(results) != n_outputs:
        return False
    for placeholder, result in zip(placeholders, results):
        if not isinstance(result, torch.fx.Node):
            return False
        before, after = placeholder.meta.get("val"), result.meta.get("val")
        if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)):
            return False
        if (before.shape, before.dtype, before.device, before.stride()) != (
            after.shape,
            after.dtype,
            after.device,
            after.stride(),
        ):
            return False
    return True


def _own_constants(source: torch.fx.GraphModule, root: torch.nn.Module, prefix: str) -> bool:
    """Move ``source``'s constants (``get_attr`` targets) onto ``root`` under ``prefix``, so
    two traced graphs' ``_tensor_constant0`` do not collide. False for an attribute path."""
    for node in source.graph.nodes:
        if node.op != "get_attr":
            continue
        if "." in node.target:
            return False
        name = f"{prefix}_{node.target}"
        setattr(root, name, getattr(source, node.target))
        node.target = name
    return True
