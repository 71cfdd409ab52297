"""Stage helpers for RNNs in captured graphs (``phi_torch_jit._rnn_layers``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from phi_torch_jit._rnn_layers import lstm_steps, lstms_unrolled, rnn_dropout, split_rnn_dropout


def test_a_captured_multi_layer_rnn_with_dropout_runs_layer_by_layer() -> None:
    """The rewrite itself: one single-layer node per layer, dropout between, nothing else."""
    for rnn in (nn.LSTM(3, 4, num_layers=3, dropout=0.3), nn.GRU(3, 4, num_layers=2, dropout=0.3),
                nn.LSTM(3, 4, num_layers=2, dropout=0.3).eval()):  # fmt: skip
        x = torch.randn(5, 2, 3)
        graph = make_fx(rnn, tracing_mode="real", pre_dispatch=True)(x)
        rewritten = split_rnn_dropout(graph)
        nodes = [n for n in graph.graph.nodes if str(n.target).startswith(("aten.lstm", "aten.g"))]
        drops = [n for n in graph.graph.nodes if n.target is torch.ops.aten.dropout.default]
        assert not any(rnn_dropout(n) for n in nodes)
        if rnn.training:
            assert rewritten == 1 and len(nodes) == rnn.num_layers
            assert len(drops) == rnn.num_layers - 1
        else:
            assert rewritten == 0 and len(nodes) == 1 and not drops
        torch.manual_seed(1)
        want = rnn(x)
        torch.manual_seed(1)
        torch.testing.assert_close(graph(x), want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "options",
    [{}, {"num_layers": 2}, {"bidirectional": True}, {"proj_size": 2, "num_layers": 2},
     {"batch_first": True, "bidirectional": True, "num_layers": 2}, {"bias": False}],
    ids=["plain", "two-layers", "bidirectional", "projections", "batch-first", "no-bias"],
)  # fmt: skip
def test_lstm_steps_compute_what_the_fused_lstm_does(options: dict[str, object]) -> None:
    """Outputs, final states and every gradient, float64, against ATen's LSTM."""
    torch.manual_seed(0)
    lstm = nn.LSTM(3, 4, **options).double()  # type: ignore[arg-type]
    x = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    want = lstm(x)
    flat = [want[0], *want[1]]
    hidden = [torch.zeros_like(t) for t in want[1]]
    args = (x, hidden, lstm._flat_weights, lstm.bias, lstm.num_layers, 0.0, True,
            lstm.bidirectional, lstm.batch_first)  # fmt: skip
    got = lstm_steps(*args)  # type: ignore[arg-type]
    for g, w in zip(got, flat):
        torch.testing.assert_close(g, w)
    weights = [x, *lstm.parameters()]
    cotangents = [torch.randn_like(t) for t in flat]
    want_grads = torch.autograd.grad(flat, weights, cotangents)
    got_grads = torch.autograd.grad(got, weights, cotangents)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


def test_only_graphs_with_an_lstm_are_copied_for_the_backend() -> None:
    gru = make_fx(nn.GRU(3, 4), tracing_mode="real", pre_dispatch=True)(torch.randn(5, 2, 3))
    assert lstms_unrolled(gru) is gru
    lstm = nn.LSTM(3, 4)
    graph = make_fx(lstm, tracing_mode="real", pre_dispatch=True)(torch.randn(5, 2, 3))
    unrolled = lstms_unrolled(graph)
    assert unrolled is not graph
    assert lstm_steps in [n.target for n in unrolled.graph.nodes]
    assert torch.ops.aten.lstm.input in [n.target for n in graph.graph.nodes]  # kept there
    x = torch.randn(5, 2, 3)
    for g, w in zip(unrolled(x), graph(x)):
        torch.testing.assert_close(g, w)
