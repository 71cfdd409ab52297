"""PhiFlow programs in the style of its demos (tests/phiflow_programs.py), each run for a few
steps eagerly, under ``ptj.jit`` and under ``install()`` (``math.jit_compile``): every field
equal to eager's, and compiled (trace counts). Optimization through a simulation: gradient
descent on a jitted loss, every iterate equal to eager's."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("phi")
pytest.importorskip("phiml")

from helpers import phiml_eager
from phi.torch.flow import math
from phiflow_programs import PROGRAMS, smoke_match

import phi_torch_jit as ptj
import phi_torch_jit.phiflow as integration

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torchscript_bodies,  # PhiML's solves script (torch.jit.script) even eagerly
    pytest.mark.filterwarnings("ignore::UserWarning"),  # PhiML: sparse CSR beta, from_numpy
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning"),
]

STEPS = 3
SIZE = 12

KNOWN_EAGER = {"reaction_diffusion": "returned a different structure while tracing"}
"""Open (closing note): the record pass returns the first field with its native dims in
another order than the trace (PhiML layouts ('y', 'x') vs ('x', 'y')) when the state was made
under a warnings filter; the step then runs eagerly with one JitWarning, equal to eager."""

MAX_TRACES = 2
"""The first state's structure, then the steady one. A point cloud's locations, which PhiFlow
keeps out of a stepped Field's variable attributes, are traced too (torch data in a PhiML
value is never a constant of the key): particles do not retrace per step."""


def _values(state: tuple[Any, ...]) -> list[Any]:
    out = []
    for x in state:
        if hasattr(x, "values"):
            out.append(x.values)
        if hasattr(x, "geometry") and not hasattr(x.geometry, "resolution"):
            out.append(x.geometry.center)  # a point cloud's locations
    return out


def _assert_like(got: tuple[Any, ...], want: tuple[Any, ...]) -> None:
    for g, w in zip(_values(got), _values(want), strict=True):
        scale = max(float(math.max(abs(w))), 1.0)
        assert float(math.max(abs(g - w))) <= 1e-5 * scale


def _jitted(fn: Any, path: str) -> tuple[Any, Any]:
    """(what the program calls, phi_torch_jit's function serving it): ``ptj.jit(fn)``, or
    ``math.jit_compile(fn)`` with ``install()`` in effect (the caller uninstalls)."""
    if path == "ptj.jit":
        jitted = ptj.jit(fn)
        return jitted, jitted
    integration.install()
    compiled = math.jit_compile(fn)
    return compiled, integration.compiled_by_phi_torch_jit(compiled)


@pytest.mark.parametrize("name", list(PROGRAMS))
@pytest.mark.parametrize("path", ["ptj.jit", "install()"])
def test_phiflow_program_equals_eager(name: str, path: str) -> None:
    with phiml_eager():
        step, state = PROGRAMS[name](SIZE)
    jitted, ours = _jitted(step, path)
    try:
        got, want = state, state
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(STEPS):
                got = jitted(*got)
                with phiml_eager():
                    want = step(*want)
                _assert_like(got, want)
    finally:
        if path == "install()":
            integration.uninstall()
    ours_warned = [str(w.message) for w in caught if issubclass(w.category, ptj.JitWarning)]
    if name in KNOWN_EAGER:
        assert len(ours_warned) <= 1 and all(KNOWN_EAGER[name] in m for m in ours_warned)
    else:
        assert not ours_warned, ours_warned
    assert ours is not None and 1 <= ours.num_traces <= MAX_TRACES


@pytest.mark.parametrize("path", ["ptj.jit", "install()"])
def test_optimization_through_a_simulation_equals_eager(path: str) -> None:
    """PhiFlow's differentiate demos: the loss of an initial velocity through two simulated
    steps, jitted, ``field.functional_gradient`` of it, gradient descent: every iterate equal
    to eager's, the loss compiled once."""
    from phi.torch.flow import field

    with phiml_eager():
        loss, start = smoke_match(SIZE)
        eager_gradient = field.functional_gradient(loss, "v0", get_output=True)
    jitted, ours = _jitted(loss, path)
    gradient = field.functional_gradient(jitted, "v0", get_output=True)
    got, want = start, start
    losses = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                loss_got, grad_got = gradient(got)
                with phiml_eager():
                    loss_want, grad_want = eager_gradient(want)
                assert abs(float(loss_got) - float(loss_want)) <= 1e-5 * abs(float(loss_want))
                losses.append(float(loss_got))
                _assert_like((grad_got,), (grad_want,))
                got, want = got - grad_got, want - grad_want
    finally:
        if path == "install()":
            integration.uninstall()
    assert losses[-1] < losses[0]  # the descent works, as eagerly
    assert not [w for w in caught if issubclass(w.category, ptj.JitWarning)]
    assert ours is not None and 1 <= ours.num_traces <= MAX_TRACES


@math.jit_compile_linear
def _tridiagonal(x: Any) -> Any:
    left, right = math.shift(x, (-1, 1), padding=0)
    return 3 * x - left - right


def _solve_and_count_levels(y: Any) -> Any:
    x = math.solve_linear(_tridiagonal, y, math.Solve("CG", 1e-5, 1e-5, x0=y * 0))
    levels = torch.unique(math.reshaped_native(y, [y.shape]).round()).shape[0]
    return x * levels


def test_a_phiml_program_the_capture_refuses_runs_eagerly_without_torchscript() -> None:
    """A PhiML program whose shape depends on values (``unique``) cannot be captured: the
    default engine runs it eagerly, warned once; only engines that may use TorchScript (engine
    "compile") fall back to tracing it with TorchScript (tests/conftest.py refuses it here)."""
    y = math.tensor(torch.tensor([1.0, 2.0, 2.0, 3.0]), math.spatial("x"))
    jitted = ptj.jit(_solve_and_count_levels)
    with pytest.warns(ptj.JitWarning, match="runs eagerly"):
        got = jitted(y)
    for _ in range(2):
        got = jitted(y)
    with phiml_eager():
        want = _solve_and_count_levels(y)
    assert float(math.max(abs(got - want))) <= 1e-5
    assert "used 'torchscript'" not in jitted.explain()
