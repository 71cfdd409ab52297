"""The values PhiML passes its custom-gradient functions beside their tensors: a solve's
``Solve`` with its initial guess ``x0`` (``adapters.phiml._functions.closure_roots``).

PhiML makes a new ``autograd.Function`` class for each call whose auxiliary arguments differ,
closing over them; compiled as recorded, the class kept the first call's initial guess. A solve
stopped after two iterations then returned the first call's answer for every guess (off by as
much as the answer itself), and a NaN guess gave a finite field where eager raises
``Diverged``. The guess is an input of the custom function now, on every engine, with one
trace. A sparse matrix argument made anew each call (its pattern compared by value in the key)
is solved as eagerly too."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("phiml")
pytest.importorskip("phi")

from helpers import phiml_eager
from phi.torch.flow import Solve, math, spatial  # PhiML on torch

import phi_torch_jit as ptj

pytestmark = [
    pytest.mark.all_engines,
    pytest.mark.torchscript_bodies,  # PhiML's eager CG scripts its loop (torch.jit.script)
    pytest.mark.filterwarnings("ignore::UserWarning"),  # PhiML: sparse CSR beta notice
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning"),
]


@math.jit_compile_linear
def _operator(x: Any) -> Any:
    return math.laplace(x, padding=0) - 0.1 * x


def _two_iterations(b: Any, x0: Any) -> Any:
    """Two CG iterations from ``x0``: their result depends on the guess as much as on ``b``."""
    solve = Solve("CG", 1e-12, 1e-12, max_iterations=2, x0=x0, suppress=[math.NotConverged])
    return math.solve_linear(_operator, b, solve)


def _converged(b: Any, x0: Any) -> Any:
    return math.solve_linear(_operator, b, Solve("CG", 1e-5, 1e-5, x0=x0))


def _field(seed: int, scale: float = 1.0) -> Any:
    torch.manual_seed(seed)
    return math.tensor(scale * torch.randn(10, 10, dtype=torch.float64), spatial("x,y"))


def _largest(x: Any) -> float:
    return float(math.max(abs(x)))


def test_a_solve_starts_from_each_calls_initial_guess() -> None:
    step = ptj.jit(_two_iterations)
    b = _field(0)
    for n in range(4):
        x0 = _field(n + 1, scale=n + 1.0)
        with phiml_eager():
            want = _two_iterations(b, x0)
        got = step(b, x0)
        assert _largest(got - want) <= 1e-5 * _largest(want)  # float32 rounding
    assert step.num_traces == 1


def test_a_nan_initial_guess_diverges_as_eagerly() -> None:
    step = ptj.jit(_converged)
    b = _field(0)
    for n in range(2):
        x0 = _field(n + 1)
        with phiml_eager():
            want = _converged(b, x0)
        assert _largest(step(b, x0) - want) <= 1e-4 * _largest(want)
    nan = _field(3, scale=float("nan"))  # the same structure: served by the same program
    with phiml_eager(), pytest.raises(math.Diverged):
        _converged(b, nan)
    for _ in range(3):  # compiled calls among them (the meter's eager samples: one in five)
        with pytest.raises(math.Diverged):
            step(b, nan)
    assert step.num_traces == 1


def test_the_gradient_through_a_solve_from_each_calls_guess_is_eagers() -> None:
    step = ptj.jit(_two_iterations)

    def gradient(solve: Any, n: int) -> torch.Tensor:
        torch.manual_seed(0)
        native = torch.randn(10, 10, dtype=torch.float64, requires_grad=True)
        x = solve(math.tensor(native, spatial("x,y")), _field(n + 1, scale=n + 1.0))
        (grad,) = torch.autograd.grad(math.l2_loss(x).native(), native)
        return grad

    for n in range(3):
        with phiml_eager():
            want = gradient(_two_iterations, n)
        torch.testing.assert_close(gradient(step, n), want, rtol=1e-5, atol=1e-5 * want.abs().max())
    assert step.num_traces == 1


def test_a_sparse_matrix_made_anew_each_call_is_solved_as_eagerly() -> None:
    """A matrix argument built every call with the same pattern: its key holds the pattern's
    indices as PhiML tensors, compared by value (probe round 34: ``!=`` on them raised while
    the second call's retrace was explained)."""

    def solve(matrix: Any, b: Any) -> Any:
        return math.solve_linear(matrix, b, Solve("CG", 1e-6, 1e-6, x0=0 * b))

    step = ptj.jit(solve)
    b = _field(0)
    for n in range(4):
        matrix = math.matrix_from_function(_operator, b)[0] * (1.0 + n)
        with phiml_eager():
            want = solve(matrix, b)
        assert _largest(step(matrix, b) - want) <= 1e-5 * _largest(want)


def _weighted(x: Any, w: Any) -> Any:
    return math.laplace(x, padding=0) - w * x


def test_a_solve_with_a_linear_function_and_its_keyword_tensor_is_solved_as_eagerly() -> None:
    """An undecorated linear function (no matrix): PhiML's torch CG refused it under our record
    pass, which PhiML takes for its jit ("not yet supported for arbitrary functions"), where
    eager code solves it (probe round 34). Its tensor keyword ``w`` is an auxiliary argument:
    each call's."""

    def solve(b: Any, w: Any) -> Any:
        return math.solve_linear(_weighted, b, Solve("CG", 1e-6, 1e-6, x0=0 * b), w=w)

    step = ptj.jit(solve)
    b = _field(0)
    for n in range(4):
        w = _field(n + 1).__abs__() + (n + 1.0)
        with phiml_eager():
            want = solve(b, w)
        assert _largest(step(b, w) - want) <= 1e-5 * _largest(want)
    assert step.num_traces == 1


def _scaled(x: Any, k: Any) -> Any:
    return x * k


def _scaled_gradient(arguments: dict[str, Any], y: Any, dy: Any) -> dict[str, Any]:
    return {"x": dy * arguments["k"]}


_SCALE = math.custom_gradient(_scaled, _scaled_gradient, auxiliary_args="k")


def test_a_custom_gradients_auxiliary_tensor_is_each_calls_after_eager_calls_with_its_value(
) -> None:  # fmt: skip
    """PhiML keeps a class per key, comparing auxiliary arguments by value: the jitted call made
    after an eager one with equal values got the eager call's class, holding its tensor, and a
    compiled backend kept that tensor's value from then on (probe round 34: a 0-dim scale
    changed in place). Our passes make their own classes."""

    def step(x: Any, k: torch.Tensor) -> Any:
        return _SCALE(x, k)

    jitted = ptj.jit(step)
    x = math.tensor(torch.ones(3), spatial("x"))
    k = torch.tensor(1.0)
    for n in range(6):
        k.fill_(1.0 + n)  # the same tensor, a new value
        with phiml_eager():
            want = step(x, k).native("x")
        torch.testing.assert_close(jitted(x, k).native("x"), want)
    # PhiML compares each call's key with the eager calls' keys by value, a tensor read the
    # trace guards: a new value retraces (and, past a few, the step runs eagerly, warned)


FIRST_GUESS = _field(1)
SOLVE = Solve("CG", 1e-12, 1e-12, max_iterations=2, x0=FIRST_GUESS, suppress=[math.NotConverged])


def _global_solve(b: Any) -> Any:
    return math.solve_linear(_operator, b, SOLVE)


def test_a_solve_kept_in_state_and_changed_in_place_retraces() -> None:
    """``SOLVE.x0 = guess``, ``SOLVE.max_iterations = ...`` on a ``Solve`` the step reads from
    a global: a library object, guarded by identity, kept the traced settings (probe 37f).
    PhiML's adapter names ``Solve`` a settings class: walked by attribute."""
    step = ptj.jit(_global_solve)
    b = _field(0)

    def like_eager() -> None:
        for _ in range(2):
            with phiml_eager():
                want = _global_solve(b)
            assert _largest(step(b) - want) <= 1e-5 * _largest(want)

    like_eager()
    SOLVE.x0 = _field(3)
    like_eager()
    SOLVE.max_iterations = math.to_int32(math.wrap(5))
    like_eager()
    SOLVE.x0, SOLVE.max_iterations = FIRST_GUESS, math.to_int32(math.wrap(2))
    like_eager()
    assert step.num_traces == 4  # a new PhiML tensor as the limit: guarded by identity
