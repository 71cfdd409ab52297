"""PhiML's state around a jitted call (adapters/phiml): its precision and default backend
are part of the cache key (``extend.Library.ambient``), and under ``phiflow.install()`` the
user's function behind PhiML's jit (one with auxiliary arguments, a ``math.gradient``) has
its globals guarded. Each was found silently wrong by a probe: float32 results after
``math.set_global_precision(64)``, a stale global behind ``auxiliary_args``."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("phiml")

from phi.torch.flow import math, spatial
from phiml import backend

import phi_torch_jit as ptj
import phi_torch_jit.phiflow as integration

pytestmark = pytest.mark.all_engines


@pytest.fixture(autouse=True)
def _phiml_defaults() -> Iterator[None]:
    default = backend.default_backend()
    yield
    math.set_global_precision(32)
    backend.set_global_default_backend(default)


def _cancelling(x: Any) -> Any:
    return (x + 1e8) - 1e8  # PhiML casts the constant to its precision


def test_the_precision_is_part_of_the_key() -> None:
    x = math.tensor([0.1, 0.2, 0.3], spatial("x"))
    jitted = ptj.jit(_cancelling)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for bits in (32, 64, 32, 64):
            math.set_global_precision(bits)
            for _ in range(2):
                got, expected = jitted(x), _cancelling(x)
                assert got.dtype == expected.dtype
                np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-6)
        with math.precision(64):
            assert jitted(x).dtype == _cancelling(x).dtype
    assert jitted.num_traces == 2
    assert "PhiML precision 64, default backend torch" in jitted.explain()


def test_the_default_backend_is_part_of_the_key() -> None:
    """Tensors PhiML makes without inputs come from its default backend (here NumPy's
    generator, which then runs the step eagerly, warned, as any NumPy draw does)."""

    def step(x: Any) -> Any:
        return x + math.random_normal(spatial(x=3))

    x = math.tensor([0.1, 0.2, 0.3], spatial("x"))
    jitted = ptj.jit(step)
    jitted(x)
    backend.set_global_default_backend(math.NUMPY)
    with pytest.warns(ptj.JitWarning, match="global generator"):
        math.seed(0)
        got = jitted(x).numpy()
    math.seed(0)
    np.testing.assert_allclose(got, step(x).numpy())
    assert jitted.num_traces == 2


SCALE = 1.0
K = 2.0


def _scaled(x: Any, k: float) -> Any:
    return x * SCALE * k


def _energy(x: Any) -> Any:
    return math.sum(math.sin(x * K) ** 2)


@pytest.mark.parametrize("kind", ["auxiliary arguments", "gradient"])
def test_the_users_function_behind_phimls_jit_is_walked_under_install(kind: str) -> None:
    global SCALE, K
    x = math.tensor([0.1, 0.2, 0.3], spatial("x"))
    if kind == "gradient":
        compiled = math.jit_compile(math.gradient(_energy, "x", get_output=False))
        eager = math.gradient(_energy, "x", get_output=False)
    else:
        compiled = math.jit_compile(_scaled, auxiliary_args="k")
        eager = lambda x: _scaled(x, 2.0)  # noqa: E731
    call = compiled if kind == "gradient" else (lambda x: compiled(x, 2.0))
    integration.install()
    saved = SCALE, K
    try:
        for change in (False, True):
            if change:
                SCALE, K = 10.0, 5.0
            for _ in range(3):
                np.testing.assert_allclose(call(x).numpy(), eager(x).numpy(), rtol=1e-5)
    finally:
        SCALE, K = saved
        integration.uninstall()


def test_library_settings_cost_nothing_at_their_defaults() -> None:
    """At 32 bits on torch PhiML adds nothing to the key (the key of a plain call stays None)."""
    from phi_torch_jit._ambient import ambient_state

    assert ambient_state() is None
    with math.precision(64):
        assert ambient_state() == (
            ("PhiML settings", (("precision", 64), ("default backend", "torch"))),
        )
    assert torch.get_default_dtype() is torch.float32
