"""Rewrites that keep inductor from computing something else than eager (_inductor_fixes)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import seeded
from torch.fx.experimental.proxy_tensor import make_fx

import phi_torch_jit as ptj
from phi_torch_jit._inductor_fixes import for_inductor

aten = torch.ops.aten


def _ema(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return acc.mul(0.9).add(a @ b, alpha=0.1) + (a @ b).add(acc, alpha=-2.0)


def _inputs() -> tuple[torch.Tensor, ...]:
    g = seeded(0)
    return (
        torch.randn(4, 3, generator=g),
        torch.randn(4, 5, generator=g),
        torch.randn(5, 3, generator=g),
    )


def test_scaled_adds_become_a_product_and_the_original_graph_stays() -> None:
    graph = make_fx(_ema)(*_inputs())
    before = graph.code
    fixed = for_inductor(graph)
    assert fixed is not graph and graph.code == before  # the fast tier keeps eager's rounding
    targets = [n.target for n in fixed.graph.nodes if n.op == "call_function"]
    assert not [n for n in fixed.graph.nodes if n.kwargs.get("alpha", 1) != 1]
    assert targets.count(aten.mul.Tensor) == 3  # 0.9 * acc, 0.1 * (a @ b), -2 * acc
    torch.testing.assert_close(fixed(*_inputs()), _ema(*_inputs()))


def test_a_graph_without_scaled_adds_is_passed_through() -> None:
    graph = make_fx(lambda x: x.add(x.sin()))(torch.ones(3))
    assert for_inductor(graph) is graph


@pytest.mark.slow
def test_an_ema_of_matrix_products_compiled_by_inductor_equals_eager() -> None:
    """Inductor 2.11/2.13 on the CPU returned ``acc * 0.9 + a @ b`` here (alpha dropped): a
    vector quantizer's EMA codebook was silently off by O(1)."""

    class Ema(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("acc", torch.zeros(4, 3))

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.acc.mul_(0.9).add_(a @ b, alpha=0.1)
            return self.acc * 2

    model = Ema()
    twin = copy.deepcopy(model)
    jitted = ptj.jit(model, engine="compile", backend="inductor", fallback="off")
    for _ in range(3):
        _, a, b = _inputs()
        torch.testing.assert_close(jitted(a, b), twin(a, b))
    torch.testing.assert_close(model.acc, twin.acc)
