"""The lazily compiled backward: one specialization per needs-input-grad pattern."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import Counter, engine_name, make_solve, seeded, torchscript_bodies, value_loop_mode
from torch import nn

import phi_torch_jit as ptj
from phi_torch_jit._backward import drop_none, restore_none

pytestmark = pytest.mark.all_engines


def test_drop_restore_round_trip() -> None:
    a, b = torch.ones(1), torch.zeros(1)
    values = (None, a, None, b)
    kept, present = drop_none(values)
    assert kept == (a, b) and present == (False, True, False, True)
    assert restore_none(kept, present) == values
    assert restore_none((), (False, False)) == (None, None)


class Diffusion(nn.Module):
    def __init__(self, solve: Any) -> None:
        super().__init__()
        self.k = nn.Parameter(torch.tensor(0.5, dtype=torch.float64))
        self.solve = solve

    def forward(self, b: torch.Tensor) -> torch.Tensor:
        return self.solve(b, self.k)


def _eager_grads(model: Diffusion, b: torch.Tensor) -> tuple[Any, Any]:
    b = b.detach().requires_grad_(b.requires_grad)
    model.k.grad = None
    (model(b) ** 2).sum().backward()
    return b.grad, model.k.grad


def test_each_pattern_gets_its_own_backward(jit_engine: str) -> None:
    counter = Counter()
    model = Diffusion(make_solve(counter))
    step = ptj.jit(model)
    b = torch.randn(10, dtype=torch.float64, requires_grad=True)
    want_b, want_k = _eager_grads(model, b)
    model.k.grad = None

    model.k.requires_grad_(False)  # first: only b needs a gradient
    step(b)
    (step(b) ** 2).sum().backward()
    assert torch.allclose(b.grad, want_b) and model.k.grad is None

    model.k.requires_grad_(True)  # then k too: must not reuse the first backward
    b.grad = None
    (step(b) ** 2).sum().backward()
    assert torch.allclose(b.grad, want_b) and torch.allclose(model.k.grad, want_k)
    if engine_name(jit_engine) == "compile":  # its program fixed which parameters get
        assert step.num_traces == 2  # gradients: a requires_grad change retraces
        return
    assert step.num_traces == 1
    (call,) = step.specializations[0].calls
    assert set(call.backward.specializations) == {(True, False), (True, True)}


def test_none_gradients_are_filtered_and_restored(jit_engine: str) -> None:
    counter = Counter()

    def mix(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x * 3 + y

    def grad(inputs: Any, outputs: Any, grads: Any) -> tuple[Any, ...]:
        counter.gradient += 1
        return grads[0] * 3, None  # "no gradient for y"

    f = ptj.custom_gradient(mix, grad)
    step = ptj.jit(lambda x, y: f(x, y) * 2, fallback="off")  # counts the compiled path
    x = torch.randn(4, requires_grad=True)
    y = torch.randn(4, requires_grad=True)
    step(x, y)
    for _ in range(3):
        x.grad = None
        step(x, y).sum().backward()
        assert torch.equal(x.grad, torch.full((4,), 6.0))
        assert y.grad is None
    # Python of the gradient ran only to build the compiled form (engine compile: and once at
    # capture, on zeros, to learn which gradients are None; docs/engines.md)
    # Without TorchScript the backward is a captured graph (engines.md): the same counts.
    assert counter.gradient == (1 if jit_engine == "torchscript" else 2)
    (call,) = step.specializations[0].calls
    spec = call.backward.specializations[(True, True)]
    assert spec.present == (True, False) and spec.mode == "traced"


def test_backward_python_runs_only_while_compiling() -> None:
    counter = Counter()
    solve = make_solve(counter)
    step = ptj.jit(lambda b, k: solve(b, k))
    b = torch.randn(8, dtype=torch.float64, requires_grad=True)
    k = torch.tensor(0.3, dtype=torch.float64)
    step(b, k)
    for _ in range(3):
        step(b, k).sum().backward()
    # the gradient's CG loop is data dependent: it runs as Python (logged) or as captured
    # blocks, never baked
    (call,) = step.specializations[0].calls
    mode = value_loop_mode(step)
    assert call.backward.specializations[(True, False)].mode == mode
    # a captured graph's backward op learns its None pattern from one run on zeros (engines.md);
    # a captured backward is checked once against the Python one, whose gradients the compile
    # run of TorchScript's functions engine computed (bodies captured as graphs instead: their
    # capture stops at the loop, and the reference is one more Python run)
    looped = mode == "looped"
    by_graph = looped and not torchscript_bodies(step)
    extra = (1 if step.engine.captures_graph else 0) + int(looped) + 2 * int(by_graph)
    assert counter.gradient == 3 + extra


@pytest.mark.all_engines
def test_a_none_gradient_reaches_grad_as_none() -> None:
    """A weight-decay optimizer would move a parameter whose .grad is zeros instead of None."""
    f = ptj.custom_gradient(lambda a, b: a * 2 + b, lambda i, o, g: (g[0] * 2, None))
    step = ptj.jit(lambda a, b: f(a, b).sum())
    a, b = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    for _ in range(2):
        a.grad = b.grad = None
        step(a, b).backward()
        assert torch.equal(a.grad, torch.full((3,), 2.0)) and b.grad is None  # type: ignore[arg-type]


class _MatVec(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, m: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(m, b)
        return m @ b

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m, b = ctx.saved_tensors
        return torch.outer(g, b), m.T @ g


def test_a_custom_functions_backward_differentiates_again_under_create_graph() -> None:
    """``create_graph=True`` through a custom function: its backward runs as Python with
    autograd recording, as eagerly, so the gradients differentiate again (the compiled
    backward's raised "element 0 of tensors does not require grad" from the second call)."""

    def step(m: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _MatVec.apply(m, b)  # type: ignore[no-untyped-call,no-any-return]

    jitted = ptj.jit(step)
    for seed in range(3):
        g = seeded(seed)
        grads = []
        for f in (jitted, step):
            m = torch.randn(4, 4, dtype=torch.float64, generator=g).requires_grad_(True)
            b = torch.randn(4, dtype=torch.float64, generator=g).requires_grad_(True)
            g.manual_seed(seed)
            (gb,) = torch.autograd.grad(f(m, b).square().sum(), b, create_graph=True)
            gb.square().sum().backward()
            grads.append((gb.detach(), m.grad, b.grad))
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want)
    assert jitted.num_traces == 1
