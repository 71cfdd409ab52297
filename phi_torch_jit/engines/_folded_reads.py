"""What an opaque call only reads, computed from the graph's own constants: computed once.

A library's solve captured around its solvers (:mod:`._solve_graphs`) passes the solver op the
parts of its matrix. In a PhiFlow step they come from constants PhiML made while the graph was
captured (``torch.tensor`` of its index and value arrays, which ``make_fx`` records as
``lift_fresh_copy`` of a constant), copied and selected on every call; the solver then compared
them bit for bit with the parts its kept matrix form was built from (``adapters.phiml._cg``):
three ``torch.equal`` over 80708 entries, about 56 us of a Karman vortex street's 1.2 ms step.

:func:`fold_read_arguments` computes such an argument once, when the graph is captured, and the
graph passes that tensor on every call: the same object, which only the graph holds and the op
does not write (:func:`._opaque_calls.register`'s ``reads``), so a solver can know it by
identity and version counter. An argument is folded only where everything it is computed from
is a fresh constant of the graph (``lift_fresh_copy`` of a ``get_attr``: data the captured code
made, held by the graph alone) or an ATen op that neither writes its arguments nor draws random
numbers, and no op of the graph writes any of them.
"""

from __future__ import annotations

from typing import Any

import torch

from .._compat import op_overload
from ._op_contracts import NAMESPACE
from ._opaque_calls import OP_NAME, reads_of

__all__ = ["fold_read_arguments", "FOLDED_PREFIX"]

FOLDED_PREFIX = "_phi_torch_jit_folded_"
"""The graph attributes holding folded arguments."""
_FRESH = "aten::lift_fresh_copy"


def fold_read_arguments(graph: torch.fx.GraphModule) -> int:
    """Fold, in place, the read-only arguments of ``graph``'s opaque calls that depend on its
    fresh constants only (see the module docstring); the number folded. The nodes that only
    computed them are removed, and the graph recompiled."""
    folded = 0
    for node in list(graph.graph.nodes):
        if not _is_opaque_call(node):
            continue
        key, tensors = node.args
        arguments = list(tensors)
        for i in range(min(reads_of(key), len(arguments))):
            value = _constant_value(graph, arguments[i])
            if value is None:
                continue
            name = f"{FOLDED_PREFIX}{sum(1 for _ in _folded(graph))}"
            graph.register_buffer(name, value, persistent=False)
            with graph.graph.inserting_before(node):
                arguments[i] = graph.graph.get_attr(name)
            folded += 1
        if arguments != list(tensors):
            node.args = (key, arguments)
    if folded:
        for node in reversed(list(graph.graph.nodes)):
            if not node.users and _removable(node):
                graph.graph.erase_node(node)
        graph.recompile()
    return folded


def _folded(graph: torch.fx.GraphModule) -> Any:
    return (name for name, _ in graph.named_buffers() if name.startswith(FOLDED_PREFIX))


def _is_opaque_call(node: torch.fx.Node) -> bool:
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, op_overload())
        and target.namespace == NAMESPACE
        and target._schema.name == f"{NAMESPACE}::{OP_NAME}"
    )


def _removable(node: torch.fx.Node) -> bool:
    """Whether ``node``, once unused, computed nothing else: a constant or a pure ATen op."""
    return node.op == "get_attr" or (node.op == "call_function" and _pure(node.target))


def _pure(target: Any) -> bool:
    """An ATen op that writes none of its arguments and draws no random numbers."""
    return (
        isinstance(target, op_overload())
        and target.namespace == "aten"
        and not target._schema.is_mutable
        and torch.Tag.nondeterministic_seeded not in target.tags
    )


def _constant_value(graph: torch.fx.GraphModule, argument: Any) -> torch.Tensor | None:
    """``argument``'s value if it depends on fresh constants and pure ops only, else None."""
    if not isinstance(argument, torch.fx.Node) or argument.op == "get_attr":
        return None  # a get_attr is passed as it is already
    ancestors: dict[torch.fx.Node, None] = {}
    pending = [argument]
    while pending:
        node = pending.pop()
        if node in ancestors:
            continue
        ancestors[node] = None
        if node.op == "get_attr":
            if not all(_fresh_copy(user) for user in node.users):
                return None  # a constant someone else may hold and write
        elif node.op != "call_function" or not _pure(node.target):
            return None  # an input, or an op that writes or draws
        if any(not _pure(user.target) and not _is_opaque_call(user) for user in node.users
               if user.op == "call_function"):  # fmt: skip
            return None  # a value the graph writes (or hands to a call that may)
        pending += node.all_input_nodes
    values: dict[torch.fx.Node, Any] = {}
    with torch.no_grad():
        for node in graph.graph.nodes:  # in the graph's order
            if node not in ancestors:
                continue
            if node.op == "get_attr":
                values[node] = getattr(graph, str(node.target))
                continue
            args = torch.fx.node.map_arg(node.args, values.__getitem__)
            kwargs = torch.fx.node.map_arg(node.kwargs, values.__getitem__)
            values[node] = node.target(*args, **kwargs)  # type: ignore[operator]
    value = values[argument]
    return value if type(value) is torch.Tensor else None


def _fresh_copy(node: torch.fx.Node) -> bool:
    target = node.target
    return isinstance(target, op_overload()) and target._schema.name == _FRESH
