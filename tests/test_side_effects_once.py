"""Side effects of a jitted call happen exactly once, as in one eager call (both engines)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines

TOTAL = torch.zeros(3)


def _accumulate(x: torch.Tensor) -> torch.Tensor:
    TOTAL.add_(x)  # a global accumulator updated in place
    return x * 2


def test_global_accumulator_is_updated_once_per_call() -> None:
    TOTAL.zero_()
    jitted = ptj.jit(_accumulate)
    for calls in range(1, 5):
        jitted(torch.ones(3))
        assert torch.equal(TOTAL, torch.full((3,), float(calls)))


class RunningMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("avg", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.avg = 0.9 * self.avg + 0.1 * x.mean()  # the buffer is replaced, not updated
        return x - self.avg


def test_buffer_reassigned_in_forward_works_without_retracing() -> None:
    jitted_net, eager_net = RunningMean(), RunningMean()
    buffer = jitted_net.avg
    jitted = ptj.jit(jitted_net)
    for i in range(5):
        x = torch.full((4,), float(i + 1), requires_grad=True)
        assert torch.allclose(jitted(x), eager_net(x))
        assert torch.allclose(jitted_net.avg, eager_net.avg)
    assert jitted.num_traces == 1
    assert jitted_net.avg is buffer and not buffer.requires_grad  # written in place


def _doubled_then_branch(x: torch.Tensor) -> torch.Tensor:
    x.mul_(2)
    return x + 1 if x.sum() > 10 else x - 1


def test_failed_value_guard_does_not_apply_an_in_place_update_twice() -> None:
    jitted = ptj.jit(_doubled_then_branch)
    x, y = torch.ones(3), torch.ones(3)
    for _ in range(4):  # the branch flips at the second call: the guard fails once
        assert torch.equal(jitted(x), _doubled_then_branch(y))
        assert torch.equal(x, y)
