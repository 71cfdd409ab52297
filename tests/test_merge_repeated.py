"""Repeated ops of a captured graph merged before AOTAutograd differentiates it
(engines._merge_repeated): what merges, what must not, and a PINN step whose backward runs
fewer matrix products, equal to eager in float64."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import phi_torch_jit as ptj
from phi_torch_jit.engines._merge_repeated import merge_repeated_ops

aten = torch.ops.aten
SEEN_MERGED, SEEN_CAPTURED = 8, 11  # matrix products in the graph the backend gets


def _graph(fn: Any, *inputs: torch.Tensor) -> torch.fx.GraphModule:
    return make_fx(fn, pre_dispatch=True)(*inputs)


def _count(graph: torch.fx.GraphModule, op: Any) -> int:
    return sum(1 for n in graph.graph.nodes if n.target is op)


def test_the_same_op_on_the_same_inputs_is_computed_once() -> None:
    def twice(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w.t()) + torch.tanh(x @ w.t())

    x, w = torch.randn(4, 3), torch.randn(5, 3)
    graph = _graph(twice, x, w)
    assert _count(graph, aten.matmul.default) == 2  # pre-dispatch: matmul
    assert merge_repeated_ops(graph.graph) == 3  # t, matmul, tanh
    graph.recompile()
    assert _count(graph, aten.matmul.default) == 1
    torch.testing.assert_close(graph(x, w), twice(x, w))


def test_random_ops_written_inputs_fresh_tensors_and_grad_modes_are_kept_apart() -> None:
    def kept(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        noise = torch.rand_like(x) + torch.rand_like(x)  # two draws
        before = x * 2
        x.add_(1)  # written: the product before and after differ
        after = x * 2
        a, b = torch.zeros(3), torch.zeros(3)
        a.add_(1)  # two fresh tensors, one written: not one tensor
        with torch.no_grad():
            frozen = before.sin()
        return noise, before, after, a + b, frozen, before.sin()

    graph = _graph(kept, torch.ones(3))
    merge_repeated_ops(graph.graph)
    graph.recompile()
    assert _count(graph, aten.rand_like.default) == 2
    assert _count(graph, aten.mul.Tensor) == 2
    assert _count(graph, aten.zeros.default) == 2
    assert _count(graph, aten.sin.default) == 2  # under no_grad and with grad
    x = torch.ones(3)
    _, before, after, summed, _, _ = graph(x)
    assert torch.equal(before, torch.full((3,), 2.0)) and torch.equal(after, before * 2)
    assert torch.equal(summed, torch.ones(3))


def _pinn_loss(net: nn.Module) -> Any:
    def loss(xt: torch.Tensor) -> torch.Tensor:
        xt = xt.detach().requires_grad_(True)
        u = net(xt)
        (du,) = torch.autograd.grad(u.sum(), xt, create_graph=True)
        (ddu,) = torch.autograd.grad(du[:, :1].sum(), xt, create_graph=True)
        return ((du[:, 1:] + u * du[:, :1] - 0.01 * ddu[:, :1]) ** 2).mean()

    return loss


def _matrix_products(graph: torch.fx.GraphModule) -> int:
    ops = (aten.mm.default, aten.addmm.default, aten.linear.default, aten.matmul.default)
    return sum(1 for n in graph.graph.nodes if n.target in ops)


@pytest.mark.parametrize("merged", [True, False], ids=["merged", "as captured"])
def test_a_pinn_steps_gradients_equal_eager_with_its_forward_copies_merged(
    merged: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The residual's gradients replay the network twice more; merged before the backend (and
    AOTAutograd) sees the graph, one copy is left to differentiate (a PINN's backward ran 26
    matrix products instead of 20; eager runs 18). Equal to eager in float64 either way."""
    from phi_torch_jit.engines import _capture

    if not merged:
        monkeypatch.setattr(_capture, "merge_repeated_ops", lambda graph: 0)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    reference = copy.deepcopy(net)
    seen: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        seen.append(_matrix_products(gm))
        return gm.forward

    jitted = ptj.jit(_pinn_loss(net), engine="compile", backend=backend)
    xt = torch.rand(32, 2, dtype=torch.float64)
    for _ in range(3):
        got = jitted(xt)
        want = _pinn_loss(reference)(xt)
        torch.testing.assert_close(got, want)
        grads = torch.autograd.grad(got, list(net.parameters()))
        wanted = torch.autograd.grad(want, list(reference.parameters()))
        for a, b in zip(grads, wanted):
            torch.testing.assert_close(a, b)
    assert jitted.num_traces == 1 and "runs eagerly" not in jitted.explain()
    assert seen == [SEEN_MERGED if merged else SEEN_CAPTURED]
