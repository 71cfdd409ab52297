"""Property-based tests: random programs give eager results and gradients (issue 6, section 3).

Profiles: "ci" (default, a few dozen examples, seconds) and "long" (``make fuzz``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import phi_torch_jit as ptj

settings.register_profile(
    "ci", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("long", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

TOLERANCE = {torch.float32: 2e-4, torch.float64: 1e-9, torch.complex64: 2e-4}


def _scale_shift(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return x * s + 1


# gradient only for x: None for s ("no gradient"), filtered out of the compiled backward
scale_shift = ptj.custom_gradient(_scale_shift, lambda i, o, g: (g[0] * i[1], None))

Op = Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]

OPS: dict[str, tuple[Op, bool]] = {  # name -> (op, works for complex)
    "sin": (lambda x, p: torch.sin(x), False),  # complex sine grows like e^|Im|: overflows
    "square": (lambda x, p: x * x / (1 + x.abs() ** 2), True),  # bounded: no float32 blow-up
    "tanh": (lambda x, p: torch.tanh(x), False),
    "affine": (lambda x, p: 2 * x - 0.5, True),
    "center": (lambda x, p: x - x.mean(dim=-1, keepdim=True), True),
    "normalize": (lambda x, p: x / (1 + x.abs().sum()), True),
    "matmul": (lambda x, p: x @ p["square"], True),
    "permute": (lambda x, p: x[..., p["perm"]], True),
    "flip": (lambda x, p: x.flip(-2), True),
    "grid_sample": (
        lambda x, p: F.grid_sample(x, p["grid"], align_corners=False),
        False,
    ),
    "custom": (lambda x, p: scale_shift(x, p["s"]), True),
    "module": (lambda x, p: p["linear"](x), False),
}


@st.composite
def programs(draw: Any) -> tuple[list[str], torch.dtype, tuple[int, ...]]:
    torch.manual_seed(draw(st.integers(0, 2**31 - 1)))  # reproducible tensors per example
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.complex64]))
    allowed = [name for name, (_, complex_ok) in OPS.items() if complex_ok or not dtype.is_complex]
    ops = draw(st.lists(st.sampled_from(allowed), min_size=1, max_size=6))
    shape = (draw(st.integers(1, 2)), 2, draw(st.integers(2, 4)), draw(st.integers(2, 5)))
    return ops, dtype, shape


def _parameters(shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, Any]:
    n, w = shape[0], shape[-1]
    real = torch.float64 if dtype == torch.float64 else torch.float32
    linear = nn.Linear(w, w, dtype=real)
    return {
        "square": torch.randn(w, w, dtype=dtype) / w,
        "perm": torch.randperm(w),
        "grid": torch.rand(n, shape[2], w, 2, dtype=real) * 2 - 1,  # keeps the shape
        "s": torch.tensor(0.7, dtype=real),
        "linear": linear,
    }


def _loss(out: torch.Tensor) -> torch.Tensor:
    return (out.abs() ** 2).sum()


@given(programs())
def test_random_programs_match_eager(
    program: tuple[list[str], torch.dtype, tuple[int, ...]],
) -> None:
    ops, dtype, shape = program
    params = _parameters(shape, dtype)

    def fn(x: torch.Tensor) -> torch.Tensor:
        for name in ops:
            if name == "grid_sample" and x.shape[-2:] != shape[-2:]:
                continue  # the sampling grid was drawn for the first shape only
            x = OPS[name][0](x, params)
        return x

    jitted = ptj.jit(fn)
    tol = TOLERANCE[dtype]
    for trial_shape in (shape, shape, (*shape[:-1], shape[-1])):
        x = torch.randn(trial_shape, dtype=dtype, requires_grad=True)
        out, want = jitted(x), fn(x)
        assert torch.allclose(out, want, rtol=tol, atol=tol, equal_nan=True)
        (got_grad,) = torch.autograd.grad(_loss(out), x)
        (want_grad,) = torch.autograd.grad(_loss(want), x)
        assert torch.allclose(got_grad, want_grad, rtol=tol, atol=tol, equal_nan=True)
    # retrace for another dtype-preserving shape (the permutation and matmul need the width)
    taller = (shape[0], shape[1], shape[2] + 1, shape[3])
    x = torch.randn(taller, dtype=dtype, requires_grad=True)
    assert torch.allclose(jitted(x), fn(x), rtol=tol, atol=tol, equal_nan=True)
    assert jitted.num_traces == 2
