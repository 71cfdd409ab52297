"""custom_gradient outside jit: an ordinary autograd function with checked contracts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import make_solve, operator

import phi_torch_jit as ptj
from phi_torch_jit._custom import TENSOR, merge_tensors, split_tensors


def test_split_merge_round_trip() -> None:
    a, b = torch.ones(1), torch.zeros(2)
    args = (a, 0.5, None, b, "x")
    tensors, template = split_tensors(args)
    assert tensors == [a, b] and template[0] is TENSOR and template[1:3] == (0.5, None)
    assert merge_tensors(template, tensors) == args


def test_eager_solve_matches_direct_solve_and_gradcheck() -> None:
    solve = make_solve()
    b = torch.randn(12, dtype=torch.float64, requires_grad=True)
    k = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    x = solve(b, k)
    assert torch.allclose(operator(x, k), b, atol=1e-8)
    assert x.grad_fn is not None and "Solve" in type(x.grad_fn).__name__
    assert torch.autograd.gradcheck(solve, (b, k))


def test_static_arguments_and_none_gradients() -> None:
    def scale(x: torch.Tensor, factor: float, y: torch.Tensor) -> torch.Tensor:
        return x * factor + y

    def grad(inputs: Any, outputs: Any, grads: Any) -> tuple[Any, ...]:
        return grads[0] * inputs[1], None, None

    f = ptj.custom_gradient(scale, grad)
    x = torch.randn(3, requires_grad=True)
    y = torch.randn(3, requires_grad=True)
    f(x, 2.0, y).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0)) and y.grad is None


def test_non_tensor_output_is_rejected() -> None:
    f = ptj.custom_gradient(lambda x: (x, 3), lambda i, o, g: (g[0],))
    with pytest.raises(ptj.CustomFunctionError, match=r"returned int as output 1"):
        f(torch.ones(2))


def test_wrong_number_of_gradients_names_function() -> None:
    def twice(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return 2 * x + y

    f = ptj.custom_gradient(twice, lambda i, o, g: (2 * g[0],))
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(
        ptj.GradientError, match=r"gradient of .*twice \(.*\) returned 1 entries for 2"
    ):
        f(x, x).sum().backward()


def test_wrong_gradient_shape_names_index_and_shapes() -> None:
    def twice(x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    f = ptj.custom_gradient(twice, lambda i, o, g: (g[0].sum(),))
    with pytest.raises(ptj.GradientError, match=r"entry 0 .* shape \(\), expected \(2,\)"):
        f(torch.ones(2, requires_grad=True)).sum().backward()


def test_gradient_for_non_tensor_input_is_rejected() -> None:
    f = ptj.custom_gradient(lambda x, s: x * s, lambda i, o, g: (g[0], g[0]))
    with pytest.raises(ptj.GradientError, match=r"input 1 is float; return None"):
        f(torch.ones(2, requires_grad=True), 2.0).sum().backward()


def test_custom_gradient_rejects_non_callables() -> None:
    with pytest.raises(TypeError, match="two callables"):
        ptj.custom_gradient(lambda x: x, None)  # type: ignore[arg-type]


class _AdjointLike(torch.autograd.Function):
    """Returns a gradient entry for every argument, also for one that needs none, in
    another shape (torchdiffeq's adjoint returns a time gradient so); eager autograd ignores
    entries for inputs that need no gradient."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y)
        return y * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return g * 2, torch.zeros(7)  # t has shape (3,)


@pytest.mark.all_engines
def test_a_gradient_entry_for_an_input_that_needs_none_is_ignored_like_eager() -> None:
    def step(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return _AdjointLike.apply(y, t).sum()  # type: ignore[no-untyped-call,no-any-return]

    jitted = ptj.jit(step)
    t = torch.linspace(0, 1, 3)
    for _ in range(2):
        y = torch.randn(3, requires_grad=True)
        y_eager = y.detach().clone().requires_grad_()
        jitted(y, t).backward()
        step(y_eager, t).backward()
        torch.testing.assert_close(y.grad, y_eager.grad)
    assert jitted.num_traces == 1
    with pytest.raises(ptj.GradientError, match="has shape"):  # one that needs it: checked
        jitted(torch.randn(3, requires_grad=True), t.requires_grad_()).backward()
