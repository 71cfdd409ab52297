"""Side effects of a jitted call happen exactly once, as in one eager call (both engines)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from helpers import captures_graph
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
    jitted = ptj.jit(jitted_net, fallback="off")  # eager code rebinds the buffer, as eager does
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


def test_weight_clipping_through_data_matches_eager() -> None:
    nets = [nn.Linear(3, 3), nn.Linear(3, 3)]
    nets[1].load_state_dict(nets[0].state_dict())

    def clipped(net: nn.Module) -> object:
        def step(x: torch.Tensor) -> torch.Tensor:
            loss = net(x).sum()
            for p in net.parameters():
                p.data.clamp_(-0.1, 0.1)  # weight clipping (WGAN style)
            return loss

        return step

    jitted, eager = ptj.jit(clipped(nets[0])), clipped(nets[1])
    x = torch.randn(2, 3)
    with pytest.warns(ptj.JitWarning, match=r"Tensor\.data"):
        for _ in range(3):
            with torch.no_grad():
                for net in nets:
                    net.weight.add_(0.5)
            assert torch.allclose(jitted(x), eager(x))  # type: ignore[operator]
            assert torch.equal(nets[0].weight, nets[1].weight)
    assert "data" not in torch.Tensor.__dict__  # the watch is gone


class RunningStats(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return x - self.mean


def test_running_statistics_under_no_grad_from_inputs_requiring_grad() -> None:
    jitted_net, eager_net = RunningStats(), RunningStats()
    jitted = ptj.jit(jitted_net)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ptj.JitWarning)  # torchscript: grad mode -> eager
        for _ in range(3):
            x = torch.randn(4, 3, requires_grad=True)
            assert torch.allclose(jitted(x), eager_net(x))
    assert torch.allclose(jitted_net.mean, eager_net.mean) and not jitted_net.mean.requires_grad


def _lent(module: nn.Module, buffers: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """A swap of the user's: the module runs with ``buffers``, then gets its own back."""
    own = {name: module._buffers[name] for name in buffers}
    module._buffers.update(buffers)
    try:
        return module(x)
    finally:
        module._buffers.update(own)


@pytest.mark.parametrize("lend", ["functional_call", "own swap"])
@pytest.mark.parametrize("module_type", [nn.BatchNorm1d, RunningMean])
def test_buffers_lent_to_a_module_for_one_call_are_updated_once_and_given_back(
    lend: str, module_type: type[nn.Module]
) -> None:
    """Buffers lent for the module's call (``torch.func.functional_call``, a swap written by
    hand) are updated as eagerly, once per call; the module keeps its own buffers."""

    def build() -> tuple[nn.Module, dict[str, torch.Tensor], Any]:
        module = module_type(2) if module_type is nn.BatchNorm1d else module_type()
        lent = {k: v.clone() + 1 for k, v in module.named_buffers()}
        if lend == "functional_call":
            return module, lent, lambda x: torch.func.functional_call(module, lent, (x,))
        return module, lent, lambda x: _lent(module, lent, x)

    (mine, my_lent, step), (theirs, their_lent, eager) = build(), build()
    own = dict(mine.named_buffers())
    jitted = ptj.jit(step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # engine torchscript runs functional_call eagerly
        for i in range(4):
            x = torch.tensor([[1.0, 2.0], [3.0, 6.0]]) * (i + 1)
            assert torch.allclose(jitted(x), eager(x))
            for name, value in their_lent.items():
                assert torch.allclose(my_lent[name], value), (i, name)
    assert all(mine._buffers[name] is buffer for name, buffer in own.items())
    for name, value in theirs.named_buffers():  # untouched, as eagerly
        assert torch.equal(own[name], value)


def test_a_module_run_with_lent_buffers_and_with_its_own_updates_each_once() -> None:
    """``functional_call(bn, lent, x)`` then ``bn(x)`` in one step: the module's own running
    statistics, first seen on its second call, are rewound like the others (they were
    updated once more per pass on the first call)."""

    def make() -> tuple[Any, nn.Module, dict[str, torch.Tensor]]:
        bn = nn.BatchNorm1d(1)
        lent = {"running_mean": torch.zeros(1)}
        step = lambda x: torch.func.functional_call(bn, lent, (x,)) + bn(x)  # noqa: E731
        return step, bn, lent

    (step, bn, lent), (eager, their_bn, their_lent) = make(), make()
    jitted = ptj.jit(step)
    for i in range(4):
        x = torch.full((2, 1), 10.0) * torch.tensor([[1.0], [2.0]]) * (i + 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # engine torchscript runs functional_call eagerly
            torch.testing.assert_close(jitted(x), eager(x))
        torch.testing.assert_close(bn.running_mean, their_bn.running_mean)
        torch.testing.assert_close(bn.running_var, their_bn.running_var)
        torch.testing.assert_close(lent["running_mean"], their_lent["running_mean"])


def test_a_cache_filled_on_the_first_call_compiles_from_the_second() -> None:
    """``if "acc" not in cache: cache["acc"] = ...`` changes the state the step reads on its
    first call only: that call runs as its record pass, and the next compiles (it ran eagerly
    for good, warned, probe round 13). A counter that changes on every call still runs
    eagerly, warned on its second call, each call counted once."""
    cache: dict[str, torch.Tensor] = {}

    def step(x: torch.Tensor) -> torch.Tensor:
        if "acc" not in cache:
            cache["acc"] = torch.zeros(2)
        cache["acc"].add_(x)
        return cache["acc"] * 2

    jitted = ptj.jit(step)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for calls in range(1, 6):
            torch.testing.assert_close(jitted(torch.ones(2)), torch.full((2,), 2.0 * calls))
    assert jitted.num_traces == 1 and not jitted.specializations[0].eager_reason

    state = {"t": 0}

    def counted(x: torch.Tensor) -> torch.Tensor:
        state["t"] += 1
        return x * state["t"]

    jitted = ptj.jit(counted)
    jitted(torch.ones(2))
    with pytest.warns(ptj.JitWarning, match="changes Python state"):
        jitted(torch.ones(2))
    for calls in range(3, 6):
        torch.testing.assert_close(jitted(torch.ones(2)), torch.full((2,), float(calls)))
    assert state["t"] == 5


def test_a_cache_per_shape_filled_while_shapes_alternate_compiles(jit_engine: str) -> None:
    """Shapes 2, 3, 2, 3: each shape's first call fills its entry (two changing passes in a
    row, of two signatures); each shape's second call changes nothing and compiles."""
    if not captures_graph(jit_engine):
        pytest.skip("TorchScript traces sizes: cache[x.shape[0]] looks a tensor up")
    cache: dict[int, torch.Tensor] = {}

    def step(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if n not in cache:
            cache[n] = torch.arange(float(n))
        return x * cache[n]

    jitted = ptj.jit(step)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for n in (2, 3, 2, 3, 2, 3):
            torch.testing.assert_close(jitted(torch.ones(n)), torch.arange(float(n)))
    assert jitted.num_traces == 2
    assert not any(s.eager_reason for s in jitted.specializations)
