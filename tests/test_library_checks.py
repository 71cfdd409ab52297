"""Stage 5 (serving): a library's checks on a compiled forward's values (PhiML's convergence
checks, deferred out of the traced solve: ``extend.Library.forward_checks``).

A float32 CG on PhiML's pressure system of a closed box diverges on about one input in five,
eagerly or compiled, decided by rounding: a compiled program whose check raises where the
Python function runs is not wrong for those inputs, so that call returns the Python function's
result and the program serves again (NOTE [a check that fails on rounding]). A toy library
stands in for PhiML here: its check on the compiled values sees them moved by ``DRIFT``, as
another order of summation moves a chaotic solve's residual. Python calls are counted to prove
which path ran; nothing is timed.

The policy lives in the serving stage, whatever the engine. The toy's checks are deferred where a
custom forward is traced by TorchScript (engine "torchscript"); on the default engine a library's
checks are deferred where its solver loop is captured (PhiML's CG: ``adapters.phiml``), which a
toy forward of a few ops is not, so these tests name engine "torchscript".
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import pytest
import torch
from helpers import Counter

import phi_torch_jit as ptj
from phi_torch_jit import _specialization, extend

LIMIT = 100.0
"""The toy solve diverges where its residual is above this."""


class _Diverged(RuntimeError):
    """The toy library's solver error (as PhiML's ``Diverged``)."""


class _Drift:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0


_Drift.__module__ = "builtins"  # test instrumentation: a library's class, no guard looks inside


DRIFT = _Drift()
"""Added to the residual the compiled program's check sees (0: the compiled values are eager's)."""
CALLS = Counter()  # CALLS.forward: runs of the jitted function's Python


def _check(residual: float) -> None:
    if residual > LIMIT:
        raise _Diverged(f"the toy solve diverged: residual {residual:.3g} > {LIMIT}")


class _Checks:
    """The toy's checks deferred while a custom forward was traced."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def __bool__(self) -> bool:
        return bool(self.tensors)

    def run(self, values: Any) -> None:
        for value in values:
            _check(float(value) + DRIFT.value)

    def traced(self, values: Any) -> None:
        pass


_COLLECTING: ContextVar[_Checks | None] = ContextVar("toy_checks", default=None)


def toy_check(residual: torch.Tensor) -> None:
    """The toy's convergence check: deferred while a forward is compiled, at once otherwise."""
    collecting = _COLLECTING.get()
    if collecting is not None:
        collecting.tensors.append(residual)
    else:
        _check(float(residual))


class _Solve(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, b: torch.Tensor) -> torch.Tensor:
        toy_check(b.abs().max())  # large right-hand sides diverge
        return b / 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad / 2


class _CheckingLibrary(extend.Library):
    name = "toy-checks"

    @contextmanager
    def _collect(self) -> Iterator[_Checks]:
        checks = _Checks()
        token = _COLLECTING.set(checks)
        try:
            yield checks
        finally:
            _COLLECTING.reset(token)

    def forward_checks(self, always: bool) -> Any:
        return self._collect()


@pytest.fixture
def checking(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extend, "_LIBRARIES", [*extend.libraries()])
    extend.register_library(_CheckingLibrary())
    monkeypatch.setattr(DRIFT, "value", 0.0)


def _step(b: torch.Tensor) -> torch.Tensor:
    CALLS.forward += 1
    return _Solve.apply(b) + 1


def _jitted() -> Any:
    # fallback="off": no eager samples, so the Python runs are counted exactly
    return ptj.jit(_step, engine="torchscript", fallback="off")


@pytest.mark.uses_torchscript
@pytest.mark.usefixtures("checking")
def test_a_check_that_raises_only_on_the_compiled_values_keeps_the_program() -> None:
    """One compiled call whose check raises where the Python function runs: that call returns
    the Python function's result, warns nothing, and the next call is compiled again."""
    step = _jitted()
    b = torch.randn(8, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        torch.testing.assert_close(step(b), b / 2 + 1)  # record: Python
        start = CALLS.forward
        torch.testing.assert_close(step(b), b / 2 + 1)
        assert CALLS.forward == start  # compiled
        DRIFT.value = 10 * LIMIT
        torch.testing.assert_close(step(b), b / 2 + 1)
        assert CALLS.forward == start + 1  # the Python function ran this call
        DRIFT.value = 0.0
        for _ in range(3):
            torch.testing.assert_close(step(b + 1), b / 2 + 1.5)
        assert CALLS.forward == start + 1  # compiled again
    assert step.num_traces == 1 and "runs eagerly" not in step.explain()


@pytest.mark.uses_torchscript
@pytest.mark.usefixtures("checking")
def test_a_check_that_raises_on_calls_in_a_row_makes_the_function_run_eagerly_warned_once() -> None:
    """CHECK_STRIKES compiled calls in a row whose checks raise where Python runs: the
    program is wrong for these inputs, not rounding; eagerly from then on, one warning."""
    step = _jitted()
    b = torch.randn(8, dtype=torch.float64)
    step(b)
    step(b)
    start = CALLS.forward
    DRIFT.value = 10 * LIMIT
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(_specialization.CHECK_STRIKES):
            torch.testing.assert_close(step(b), b / 2 + 1)
            assert ("runs eagerly" in step.explain()) == (n == _specialization.CHECK_STRIKES - 1)
        DRIFT.value = 0.0
        torch.testing.assert_close(step(b), b / 2 + 1)
    assert CALLS.forward == start + _specialization.CHECK_STRIKES + 1  # Python from then on
    warned = [w for w in caught if issubclass(w.category, ptj.JitWarning)]
    assert len(warned) == 1 and "_Diverged" in str(warned[0].message)


@pytest.mark.uses_torchscript
@pytest.mark.usefixtures("checking")
def test_a_check_that_raises_eagerly_too_raises_the_users_error() -> None:
    """A solve that diverges on these inputs whatever the rounding: the library's error, as
    eagerly; it counts no strike, and the program keeps serving."""
    step = _jitted()
    b = torch.randn(8, dtype=torch.float64)
    step(b)
    step(b)
    for _ in range(_specialization.CHECK_STRIKES + 1):
        with pytest.raises(_Diverged, match="residual"):
            step(b * 10 * LIMIT)
    start = CALLS.forward
    torch.testing.assert_close(step(b), b / 2 + 1)
    assert CALLS.forward == start and "runs eagerly" not in step.explain()


class _Outer(torch.autograd.Function):
    """A custom function whose gradient runs a solve with a check (an adjoint solve)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 3

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        CALLS.gradient += 1
        return _Solve.apply(grad) * 6  # grad / 2 * 6: 3 * grad


@pytest.mark.uses_torchscript
@pytest.mark.usefixtures("checking")
def test_a_check_that_raises_only_in_the_compiled_backward_runs_the_gradient_as_python() -> None:
    """The adjoint solve in a compiled backward diverged by rounding where eager's converges:
    that backward raised ``Diverged`` where eager autograd returns gradients. It now runs the
    user's gradient as Python for that call (its own checks on real values); the compiled
    backward serves again at the next."""
    step = ptj.jit(lambda x: _Outer.apply(x).sin(), engine="torchscript", fallback="off")
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    want = 3 * (3 * x).cos()
    for drift in (0.0, 0.0, 10 * LIMIT, 0.0):
        DRIFT.value = drift
        before = CALLS.gradient
        (grad,) = torch.autograd.grad(step(x).sum(), x)
        torch.testing.assert_close(grad, want.detach())
        if drift:
            assert CALLS.gradient == before + 1  # the gradient ran as Python this call
    assert CALLS.gradient == before  # compiled again after it
    assert step.num_traces == 1 and "runs eagerly" not in step.explain()
