"""Multi-layer RNNs with dropout in a captured graph: one node per layer, dropout between.

torch's Python decomposition of ``aten.lstm``/``gru``/``rnn_tanh``/``rnn_relu`` (the one
AOTAutograd and ``torch.func`` apply; torch 2.11-2.15) drops the dropout between layers in
train mode: a captured multi-layer GRU/LSTM would train as if in eval mode. Eager ATen runs
the layers one after the other and applies ``dropout(p, train=True)`` to each layer's output
but the last's. :func:`split_rnn_dropout` rewrites each such node of a captured graph into
exactly that: single-layer nodes of the same op (whose decomposition is faithful: there is no
dropout to drop) with ``aten.dropout`` between them, and the final hidden states concatenated
by layer. The random draws happen in eager's order, one mask per layer output.

Contract: works on the ATen graph a capture produced (pre-dispatch or not); nodes without
dropout, in eval mode or with one layer are left as they are. ATen only: no stage imported.
"""

from __future__ import annotations

import copy
import operator
from typing import Any

import torch

__all__ = ["RNN_OPS", "lstm_steps", "lstms_unrolled", "rnn_dropout", "split_rnn_dropout"]

_aten = torch.ops.aten

_PADDED = {  # op -> (index of num_layers in its arguments, hidden states are a list)
    _aten.lstm.input: (4, True),
    _aten.gru.input: (4, False),
    _aten.rnn_tanh.input: (4, False),
    _aten.rnn_relu.input: (4, False),
}
_PACKED = {  # the PackedSequence forms: (data, batch_sizes, hx, params, ...)
    _aten.lstm.data: (5, True),
    _aten.gru.data: (5, False),
    _aten.rnn_tanh.data: (5, False),
    _aten.rnn_relu.data: (5, False),
}
_RNNS = {**_PADDED, **_PACKED}
RNN_OPS = frozenset(_RNNS)
"""The RNN ops: tagged random (for their dropout), which draw nothing where
:func:`rnn_dropout` says None."""


def rnn_dropout(node: torch.fx.Node) -> str | None:
    """``"a 2-layer LSTM with dropout 0.2 in train mode"`` for a node whose decomposition
    would drop dropout, else None."""
    if node.op != "call_function" or node.target not in _RNNS:
        return None
    op: Any = node.target
    at, _ = _RNNS[op]
    num_layers, dropout, train = node.args[at : at + 3]
    if not (train and dropout and isinstance(num_layers, int) and num_layers > 1):
        return None
    name = op._opname.upper().replace("RNN_", "RNN (")
    name += ")" if "(" in name else ""
    return f"a {num_layers}-layer {name} with dropout {dropout} in train mode"


def split_rnn_dropout(graph: torch.fx.GraphModule) -> int:
    """Rewrite every multi-layer RNN node with train-mode dropout into single layers with
    ``aten.dropout`` between them; returns how many nodes were rewritten."""
    nodes = [n for n in graph.graph.nodes if rnn_dropout(n)]
    for node in nodes:
        _split(graph.graph, node)
    if nodes:
        graph.graph.lint()
        graph.recompile()
    return len(nodes)


def _split(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    op: Any = node.target
    at, paired = _RNNS[op]
    args: list[Any] = list(node.args)
    hx_at = at - 3  # (input, hx, params, ...) or (data, batch_sizes, hx, params, ...)
    hx, params = args[hx_at], list(args[hx_at + 1])
    num_layers: int = args[at]
    dropout, train, bidirectional = args[at + 1 : at + 4]
    directions = 2 if bidirectional else 1
    per_layer = len(params) // num_layers
    hidden = list(hx) if paired else [hx]
    drop = _aten.dropout.default
    with graph.inserting_before(node):
        layer_input = args[0]
        finals: list[list[torch.fx.Node]] = [[] for _ in hidden]
        for layer in range(num_layers):
            rows = (layer * directions, (layer + 1) * directions)
            states = [graph.call_function(_aten.slice.Tensor, (h, 0, *rows)) for h in hidden]
            layer_args = list(args)
            layer_args[0] = layer_input
            layer_args[hx_at] = states if paired else states[0]
            layer_args[hx_at + 1] = params[layer * per_layer : (layer + 1) * per_layer]
            layer_args[at : at + 2] = [1, 0.0]
            out = graph.call_function(op, tuple(layer_args))
            outputs = [graph.call_function(operator.getitem, (out, i))
                       for i in range(1 + len(hidden))]  # fmt: skip
            for final, state in zip(finals, outputs[1:]):
                final.append(state)
            layer_input = outputs[0]
            if layer < num_layers - 1:
                layer_input = graph.call_function(drop, (layer_input, dropout, train))
        results = [layer_input] + [
            graph.call_function(_aten.cat.default, (final, 0)) for final in finals
        ]
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            index: Any = user.args[1]
            user.replace_all_uses_with(results[index])
            graph.erase_node(user)
        else:  # the tuple itself is used: rebuild it
            with graph.inserting_before(user):
                rebuilt = graph.call_function(tuple, (results,))
            user.replace_input_with(node, rebuilt)
    graph.erase_node(node)


def lstms_unrolled(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``module``, or a copy whose LSTM nodes run as :func:`lstm_steps` (for a backend).

    torch's decomposition of ``aten.lstm`` on the CPU picks oneDNN's inference-only layer op
    whenever the *input* needs no gradient, also when the weights do (training): AOTAutograd
    then compiles a program that fails when it runs ("expected all tensors_saved_with_vc_check
    to be Tensors", inductor: "expected Tensor() for op: aten.mkldnn_rnn_layer"). The backend
    gets the time steps as plain ops instead; the graph served uncompiled keeps the fused op.
    """
    if not any(n.target is _aten.lstm.input for n in module.graph.nodes):
        return module
    module = copy.deepcopy(module)
    for node in module.graph.nodes:
        if node.op == "call_function" and node.target is _aten.lstm.input:
            node.target = lstm_steps
    module.graph.lint()
    module.recompile()
    return module


def lstm_steps(
    input: torch.Tensor,
    hx: list[torch.Tensor],
    params: list[torch.Tensor],
    has_biases: bool,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
    batch_first: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten.lstm.input`` as ops over the time steps (same arguments and results): per layer
    and direction ``i, f, g, o`` from ``x W_ih^T + b_ih + h W_hh^T + b_hh``, ``c = f c + i g``,
    ``h = o tanh(c)`` (times ``W_hr^T`` with projections); eager's dropout between layers."""
    directions = 2 if bidirectional else 1
    per = len(params) // (num_layers * directions)
    x = input.transpose(0, 1) if batch_first else input
    h0, c0 = hx
    hs, cs = [], []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            k = layer * directions + direction
            weights = params[k * per : (k + 1) * per]
            w_ih, w_hh = weights[0], weights[1]
            b_ih, b_hh = (weights[2], weights[3]) if has_biases else (None, None)
            w_hr = weights[-1] if per in (3, 5) else None
            gates_x = torch.nn.functional.linear(x, w_ih, b_ih)
            h, c = h0[k], c0[k]
            steps = range(x.size(0) - 1, -1, -1) if direction else range(x.size(0))
            out: list[torch.Tensor] = [h] * x.size(0)
            for t in steps:
                gates = gates_x[t] + torch.nn.functional.linear(h, w_hh, b_hh)
                i, f, g, o = gates.chunk(4, 1)
                c = f.sigmoid() * c + i.sigmoid() * g.tanh()
                h = o.sigmoid() * c.tanh()
                if w_hr is not None:
                    h = torch.nn.functional.linear(h, w_hr)
                out[t] = h
            outputs.append(torch.stack(out))
            hs.append(h)
            cs.append(c)
        x = torch.cat(outputs, -1) if directions == 2 else outputs[0]
        if train and dropout and layer < num_layers - 1:
            x = torch.nn.functional.dropout(x, dropout, True)
    y = x.transpose(0, 1) if batch_first else x
    return y, torch.stack(hs), torch.stack(cs)
