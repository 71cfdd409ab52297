"""A captured graph as bytes and back, node for node, for a compile in a worker process.

``pickle`` of a ``GraphModule`` keeps only its generated code and traces that code again when
it is loaded; an op without traced inputs then runs at load time and its result becomes a
constant (``torch.randn(3)`` in a graph would give the same numbers at every call). Here each
node is kept as it is (op, name, target, arguments), its tensor attributes with it, and the
graph is rebuilt from them without running any op. The target of a call is kept as the name
of torch's op (``aten::add.Tensor``), or pickled (``operator.getitem``).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from .._compat import op_overload

__all__ = ["graph_bytes", "graph_from"]


class _Node:
    """A reference to an earlier node, by name."""

    def __init__(self, name: str) -> None:
        self.name = name


class _Op:
    """A torch op, by its qualified name and overload."""

    def __init__(self, name: str) -> None:
        self.name = name

    def resolve(self) -> Any:
        namespace, _, rest = self.name.partition("::")
        op, _, overload = rest.partition(".")
        return getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")


def graph_bytes(graph: torch.fx.GraphModule) -> bytes:
    """The graph's nodes and tensor attributes, pickled; raises where a value does not pickle
    or the graph calls modules."""
    nodes, attributes = [], {}
    overload = op_overload()
    for node in graph.graph.nodes:
        if node.op in ("call_module", "call_method"):
            raise ValueError(f"a graph with {node.op} nodes is not kept node for node")
        target = node.target
        if isinstance(target, overload):
            target = _Op(target.name())
        elif node.op == "get_attr":
            attributes[target] = _attribute(graph, target)
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), _by_name)
        nodes.append((node.op, node.name, target, args, kwargs))
    return pickle.dumps((nodes, attributes, dict(graph.meta)), pickle.HIGHEST_PROTOCOL)


def _by_name(node: torch.fx.Node) -> Any:
    return _Node(node.name)


def _attribute(graph: torch.fx.GraphModule, path: str) -> Any:
    value: Any = graph
    for part in path.split("."):
        value = getattr(value, part)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"the graph's attribute {path} is not a tensor")
    return value


def graph_from(data: bytes) -> torch.fx.GraphModule:
    """The graph :func:`graph_bytes` kept: the same nodes, names, targets and attributes."""
    nodes, attributes, meta = pickle.loads(data)
    graph = torch.fx.Graph()
    made: dict[str, torch.fx.Node] = {}
    for op, name, target, args, kwargs in nodes:
        if isinstance(target, _Op):
            target = target.resolve()
        args, kwargs = _nodes_in(args, made), _nodes_in(kwargs, made)
        if op == "output":
            graph.output(args[0])
            continue
        node = graph.create_node(op, target, args, kwargs, name=name)
        made[name] = node
    module = torch.fx.GraphModule(attributes, graph)
    module.meta.update(meta)
    return module


def _nodes_in(value: Any, made: dict[str, torch.fx.Node]) -> Any:
    if isinstance(value, _Node):
        return made[value.name]
    if isinstance(value, tuple):
        return tuple(_nodes_in(item, made) for item in value)
    if isinstance(value, list):
        return [_nodes_in(item, made) for item in value]
    if isinstance(value, dict):
        return {key: _nodes_in(item, made) for key, item in value.items()}
    if isinstance(value, slice):
        return slice(*(_nodes_in(x, made) for x in (value.start, value.stop, value.step)))
    return value
