"""Repeated ops of a captured graph merged before it is differentiated (gradients inside).

A gradient taken inside the step is captured by replaying the ops it differentiates
(:mod:`.._inner_grad`): the forward's ops appear in the graph once per gradient taken through
them. AOTAutograd merges the copies only after it has built the backward, by then the
backward holds one gradient contribution per copy: a PINN's training step ran 26 matrix
products in its backward where eager autograd runs 18. :func:`merge_repeated_ops` merges the
copies first: a node computing the same ATen op on the same inputs as an earlier one, in the
same grad mode, is replaced by it.

Not merged: ops that write in place or draw random numbers, ops whose inputs are written in
place anywhere in the graph (nor views of those), fresh tensors that are written later, ops
that are not ATen's (custom functions: they may run Python), and nothing across a call that
is not an ATen op (an autocast region, a higher-order op): such a call starts a new epoch.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from .._compat import grad_mode_setter, op_overload

__all__ = ["merge_repeated_ops"]


def merge_repeated_ops(graph: torch.fx.Graph) -> int:
    """Merge the repeated pure ATen ops of ``graph`` in place; return how many were merged."""
    written = _written(graph)
    set_grad_enabled = getattr(*grad_mode_setter())
    seen: dict[Any, torch.fx.Node] = {}
    grad_mode, epoch, merged = True, 0, 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is set_grad_enabled:
            grad_mode = bool(node.args[0])
            continue
        if not _mergeable(node, written):
            if node.target is not operator.getitem and not _aten(node.target):
                epoch += 1  # a region or higher-order op: no merging across it
            continue
        try:
            key = (node.target, _frozen(node.args), _frozen(node.kwargs), grad_mode, epoch)
            earlier = seen.setdefault(key, node)
        except TypeError:  # an unhashable argument
            continue
        if earlier is not node:
            node.replace_all_uses_with(earlier)
            graph.erase_node(node)
            merged += 1
    return merged


def _aten(target: Any) -> bool:
    return isinstance(target, op_overload()) and target.namespace == "aten"


def _mergeable(node: torch.fx.Node, written: set[torch.fx.Node]) -> bool:
    if node in written or any(a in written for a in node.all_input_nodes):
        return False
    if node.target is operator.getitem:
        return True
    op: Any = node.target
    if not _aten(op):
        return False
    return not op._schema.is_mutable and torch.Tag.nondeterministic_seeded not in op.tags


def _written(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes written in place by an op of the graph, the bases they are views of, and the
    views of those."""
    written: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "call_function" and (
            (not _aten(node.target) and node.target is not operator.getitem)
            or (_aten(node.target) and node.target._schema.is_mutable)
        ):  # fmt: skip
            written.update(node.all_input_nodes)  # a custom op may write its inputs too
    changed = True
    while changed:  # through views, both ways
        changed = False
        for node in graph.nodes:
            if node.op != "call_function" or not _is_view(node.target):
                continue
            base = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
            if base is None:
                continue
            if (node in written) != (base in written):
                written.update((node, base))
                changed = True
    return written


def _is_view(target: Any) -> bool:
    return _aten(target) and any(r.alias_info is not None for r in target._schema.returns)


def _frozen(value: Any) -> Any:
    """A hashable form of node arguments (lists become tuples)."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, torch.fx.Node):
        return value
    hash(value)
    return (type(value), value)
