"""PhiFlow/PhiML state a step reads, changed between calls (probe 52): a NumPy-backed field
or boundary value changed in place, and ``math.seed`` called inside the step. Each was
silently wrong on every engine: PhiML computes on NumPy data before any torch op sees it,
and PhiML's seeding of torch's generator was not noticed (only the user's own call was)."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

pytest.importorskip("phi")
pytest.importorskip("phiml")
from helpers import phiml_eager
from phi.torch.flow import (
    ZERO_GRADIENT,
    CenteredGrid,
    Noise,
    field,
    math,
    spatial,
)
from phiml.math import extrapolation

import phi_torch_jit as ptj

pytestmark = [
    pytest.mark.all_engines,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def _numpy(grid: Any) -> np.ndarray:
    return np.asarray(grid.values.numpy("x,y"))


def _state() -> Any:
    math.seed(0)
    return CenteredGrid(Noise(), ZERO_GRADIENT, x=8, y=8)


def _like_eager(jitted: Any, step: Any, state: Any) -> None:
    with phiml_eager():
        want = _numpy(step(state))
    np.testing.assert_allclose(_numpy(jitted(state)), want, rtol=1e-5, atol=1e-6)


def test_a_numpy_backed_field_changed_in_place_retraces() -> None:
    mask = CenteredGrid(math.tensor(np.ones((8, 8), np.float32), spatial("x,y"), convert=False),
                        0, x=8, y=8)  # fmt: skip

    def step(s: Any) -> Any:
        return s * (mask * 2)

    state, jitted = _state(), ptj.jit(step)
    for _ in range(3):
        _like_eager(jitted, step, state)
    mask.values.native("x,y")[:] = 0.5  # the array is the field's own
    for _ in range(2):
        _like_eager(jitted, step, state)
    assert jitted.num_traces == 2


def test_a_numpy_backed_boundary_value_changed_in_place_retraces() -> None:
    boundary = extrapolation.ConstantExtrapolation(
        math.tensor(np.array(1.0, np.float32), convert=False)
    )

    def step(s: Any) -> Any:
        return field.laplace(s.with_extrapolation(boundary))

    state, jitted = _state(), ptj.jit(step)
    for _ in range(3):
        _like_eager(jitted, step, state)
    boundary.value.native()[...] = 4.0
    _like_eager(jitted, step, state)
    assert jitted.num_traces == 2


def test_math_seed_inside_the_step_runs_it_eagerly_warned() -> None:
    def step(s: Any) -> Any:
        math.seed(0)
        return s + math.random_normal(s.shape)

    state, jitted = _state(), ptj.jit(step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            _like_eager(jitted, step, state)
    assert any("manual_seed" in str(w.message) for w in caught), [str(w.message) for w in caught]
