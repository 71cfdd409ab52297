"""A captured FX graph as one straight-line Python function: the fast tier without TorchScript.

``GraphModule.forward`` calls each op as ``torch.ops.aten.<op>.<overload>(...)``: four
attribute lookups and a Python ``OpOverload.__call__`` per op, which made the captured smoke
step 1.7-1.9x slower than eager code (docs/engines.md). :func:`straight_line` generates the
same sequence of calls with each op bound once to the C function eager code would call
(``torch.<op>`` or ``Tensor.<op>``, whose argument parsers come from the same schema), so the
captured program runs at eager speed (0.98-1.03x) with no tracer involved. Ops without such a
function (``aten.slice``, our ``phi_torch_jit::`` ops...) keep their overload's C handle.
Intermediate values are released after their last use, as FX does.
"""

from __future__ import annotations

import operator
import types
from collections.abc import Callable
from typing import Any

import torch

from .._compat import eager_functions, op_overload

__all__ = ["straight_line", "tensor_ops_only"]

_C_FUNCTIONS = (types.BuiltinFunctionType, types.MethodDescriptorType)

_HAND_WRITTEN = frozenset(
    "to type new_tensor tensor as_tensor asarray frombuffer range sparse_coo_tensor "
    "sparse_compressed_tensor sparse_csr_tensor sparse_csc_tensor sparse_bsr_tensor "
    "sparse_bsc_tensor _sparse_coo_tensor_unsafe _sparse_compressed_tensor_unsafe "
    "_sparse_csr_tensor_unsafe _sparse_csc_tensor_unsafe _sparse_bsr_tensor_unsafe "
    "_sparse_bsc_tensor_unsafe".split()
)
"""Ops whose Python function of the same name is bound by hand in torch, with arguments that
are not their schema's: ``Tensor.to`` takes no ``layout=`` or ``pin_memory=``, which the
``aten.to.dtype_layout`` overload a capture records passes (a PhiFlow step failed so on the
straight-line tier with a TypeError); ``torch.sparse_coo_tensor`` takes ``size`` where the
schema has other overloads. These keep their overload's C handle."""


def _fast_callable(target: Any) -> Any:  # target: an OpOverload or a plain callable
    """The C callable that runs ``target`` with the arguments FX recorded for it."""
    if not isinstance(target, op_overload()):
        return target  # operator.getitem, torch._C._set_grad_enabled...
    if target.namespace == "aten":
        name = target._schema.name.split("::", 1)[1]
        if name in _HAND_WRITTEN:
            return target._op
        for owner in (eager_functions(), torch.Tensor):
            found = getattr(owner, name, None)
            if isinstance(found, _C_FUNCTIONS):  # not properties, not Python wrappers
                return found
    return target._op


def tensor_ops_only(graph: torch.fx.GraphModule) -> bool:
    """Whether every call is an op (no grad-mode or autocast switch that a trace would drop)."""
    return all(
        isinstance(node.target, op_overload()) or node.target is operator.getitem
        for node in graph.graph.nodes
        if node.op == "call_function"
    )


class _Source:
    """The generated function's lines and the objects its names stand for."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.bound: dict[str, Any] = {}

    def bind(self, value: Any) -> str:
        name = f"_{len(self.bound)}"
        self.bound[name] = value
        return name

    def render(self, arg: Any, names: dict[torch.fx.Node, str]) -> str:
        if isinstance(arg, torch.fx.Node):
            return names[arg]
        if isinstance(arg, tuple):
            return "(" + "".join(self.render(a, names) + ", " for a in arg) + ")"
        if isinstance(arg, list):
            return "[" + ", ".join(self.render(a, names) for a in arg) + "]"
        if arg is None or type(arg) in (bool, int):
            return repr(arg)
        return self.bind(arg)  # floats (nan, inf), dtypes, devices, slices...


def straight_line(graph: torch.fx.GraphModule) -> Callable[..., Any]:
    """``graph.forward`` as generated Python that calls each op's C function directly.

    Raises:
        NotImplementedError: a node kind make_fx does not produce (call_module, call_method).
    """
    nodes = list(graph.graph.nodes)
    last_use = {used: i for i, node in enumerate(nodes) for used in node.all_input_nodes}
    dies_at: dict[int, list[torch.fx.Node]] = {}
    for used, i in last_use.items():
        dies_at.setdefault(i, []).append(used)
    source, names, params = _Source(), {}, []
    for i, node in enumerate(nodes):
        names[node] = name = f"v{i}"
        if node.op == "placeholder":
            params.append(name)
            continue
        if node.op == "output":
            source.lines.append(f"return {source.render(node.args[0], names)}")
            break
        source.lines.append(f"{name} = {_expression(node, graph, source, names)}")
        dead = [names[n] for n in dies_at.get(i, ()) if n.op != "placeholder"]
        dead += [name] if not node.users else []
        if dead:
            source.lines.append("del " + ", ".join(dead))
    body = "".join(f"    {line}\n" for line in source.lines)
    code = f"def captured({', '.join(params)}):\n{body}"
    namespace = dict(source.bound)
    exec(compile(code, f"<phi_torch_jit straight line {id(graph):x}>", "exec"), namespace)
    return namespace["captured"]  # type: ignore[no-any-return]


def _expression(
    node: torch.fx.Node, graph: torch.fx.GraphModule, source: _Source, names: dict[Any, str]
) -> str:
    if node.op == "get_attr":
        value: Any = graph
        for part in str(node.target).split("."):
            value = getattr(value, part)
        return source.bind(value)
    if node.op != "call_function":
        raise NotImplementedError(f"straight_line: node kind {node.op!r}")
    args = [source.render(a, names) for a in node.args]
    args += [f"{k}={source.render(v, names)}" for k, v in node.kwargs.items()]
    return f"{source.bind(_fast_callable(node.target))}({', '.join(args)})"
