"""Classes of real models' code (issue "Real models from real libraries"), each reduced to
plain torch, on every engine: equal to eager (values, gradients, optimizer state, RNG draws),
or run eagerly with exactly one JitWarning that says why. Never a crash, never silently wrong.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines

Step = Callable[..., Any]


def _run(step: Step, args: Any, calls: int) -> list[Any]:
    return [step(*args) for _ in range(calls)]


def _assert_equal(got: Any, want: Any) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def jitted_like_eager(
    make: Callable[[], tuple[Step, tuple[Any, ...]]], calls: int = 4, eager_reason: str = ""
) -> ptj.JitFunction[..., Any]:
    """Build the program twice from the same seed; run one eagerly and one jitted ``calls``
    times; results equal. ``eager_reason``: the jitted one must warn once with that text
    (and then runs eagerly); empty: it must not warn."""
    torch.manual_seed(0)
    step, args = make()
    want = _run(step, args, calls)
    torch.manual_seed(0)
    step, args = make()
    jitted = ptj.jit(step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _run(jitted, args, calls)
    ours = [w for w in caught if issubclass(w.category, ptj.JitWarning)]
    if eager_reason:
        assert len(ours) == 1, [str(w.message) for w in ours]
        assert eager_reason in str(ours[0].message)
    else:
        assert not ours, [str(w.message) for w in ours]
    _assert_equal(got, want)
    return jitted


def _training(model: nn.Module, x: torch.Tensor) -> tuple[Step, tuple[Any, ...]]:
    """A training step as users write it: loss, backward, optimizer step; returns the loss,
    the parameter gradients and the optimizer's state after the step."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        return model(x).square().mean()

    jittable = {"loss": loss_of}

    def step(x: torch.Tensor) -> Any:
        optimizer.zero_grad()
        loss = jittable["loss"](x)
        loss.backward()
        optimizer.step()
        grads = [p.grad.clone() for p in model.parameters()]
        moments = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
        return loss.detach(), grads, moments

    step.jittable = jittable  # type: ignore[attr-defined]
    return step, (x,)


# 1. A parameter or buffer slot set to None -----------------------------------------------


class _NoneSlots(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3, bias=False)
        self.conv = nn.Conv1d(1, 2, 3, padding=1, bias=False)
        self.norm = nn.LayerNorm(3, bias=False)
        self.register_buffer("shift", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.linear(x))
        y = self.conv(y.unsqueeze(1)).sum(1)
        return y if self.shift is None else y + self.shift


def test_parameters_and_buffers_set_to_none_train_like_eager() -> None:
    def make() -> tuple[Step, tuple[Any, ...]]:
        model = _NoneSlots()
        step, args = _training(model, torch.randn(5, 4))
        loss = ptj.jit(step.jittable["loss"])  # type: ignore[attr-defined]
        step.jittable["loss"] = loss  # type: ignore[attr-defined]
        return step, args

    torch.manual_seed(0)
    step, args = make()
    torch.manual_seed(0)
    eager = _NoneSlots()
    eager_step, _ = _training(eager, args[0])
    for _ in range(3):
        _assert_equal(step(*args), eager_step(*args))


def test_a_none_slot_filled_later_retraces() -> None:
    model = nn.Linear(3, 2, bias=False)
    f = ptj.jit(lambda x: model(x))
    x = torch.randn(4, 3)
    _assert_equal(f(x), model(x))
    f(x)
    model.bias = nn.Parameter(torch.ones(2))
    _assert_equal(f(x), model(x))
    assert f.num_traces == 2


# 3. ctx.needs_input_grad inside an autograd.Function's forward -----------------------------


class _Kernel(torch.autograd.Function):
    """Like a Gaussian-process kernel: forward refuses work nobody asked for."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if ctx.needs_input_grad[1]:
            raise RuntimeError("b must not require grad")
        ctx.save_for_backward(b)
        return a * b if ctx.needs_input_grad[0] else a * b + 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (b,) = ctx.saved_tensors
        return grad * b, None


def test_needs_input_grad_in_forward_is_eagers() -> None:
    f = ptj.jit(lambda a, b: _Kernel.apply(a, b))
    b = torch.randn(3)
    for requires in (True, False, True):
        a = torch.randn(3, requires_grad=requires)
        _assert_equal(f(a, b), _Kernel.apply(a, b))
        if requires:
            (got,) = torch.autograd.grad(f(a, b).sum(), a)
            _assert_equal(got, b)
    with torch.no_grad():
        _assert_equal(f(a, b), a * b + 1)
    with pytest.raises(RuntimeError, match="b must not require grad"):
        f(a, b.requires_grad_())
