"""Stage 1: the record pass finds modules and custom calls, and leaves no hook behind."""

from __future__ import annotations

import warnings

import torch
from helpers import make_solve
from torch import nn

import phi_torch_jit as ptj
from phi_torch_jit._record import record


def _global_pre_hooks() -> int:
    return len(nn.modules.module._global_forward_pre_hooks)


def test_called_modules_are_recorded_roots_only() -> None:
    inner = nn.Linear(3, 3)
    outer = nn.Sequential(inner, nn.Tanh())
    other = nn.Linear(3, 3)

    def f(x: torch.Tensor) -> torch.Tensor:
        return other(outer(x))

    before = _global_pre_hooks()
    _, recording = record(f, (torch.randn(3),), {}, "f", [])
    assert list(recording.modules.values()) == [outer, inner, outer[1], other]
    assert recording.root_modules() == [outer, other]
    assert _global_pre_hooks() == before  # the hook lives only during the pass


def test_register_module_call_records_uncalled_modules() -> None:
    class Weights(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def apply_to(self, x: torch.Tensor) -> torch.Tensor:
            ptj.register_module_call(self)
            return x * self.w

    weights = Weights()
    _, recording = record(weights.apply_to, (torch.randn(3),), {}, "f", [])
    assert recording.root_modules() == [weights]
    weights.apply_to(torch.randn(3))  # outside jit it is a no-op


def test_custom_calls_are_recorded_as_copies() -> None:
    solve = make_solve()
    b, k = torch.randn(6), torch.tensor(0.1)

    def f(b: torch.Tensor) -> torch.Tensor:
        x = solve(b, k)
        x.add_(1)  # in-place edits after the call must not reach the recording
        return x

    _, recording = record(f, (b,), {}, "f", [])
    (call,) = recording.calls
    assert call.function is solve and call.single
    assert call.args[0] is not b and torch.equal(call.args[0], b)
    assert torch.allclose(call.outputs[0], solve(b, k))


def test_a_step_calling_torch_cond_runs_as_eagerly_never_crashes() -> None:
    """``torch.cond`` compiles its branches with dynamo inside the step, and dynamo traced
    through the record pass's torch-function mode: the first jitted call raised
    UncapturedHigherOrderOpError where eager code ran (found by probe round 19)."""
    weight = torch.full((4,), 2.0)

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda x: x * weight, lambda x: x - weight, (x,))

    jitted = ptj.jit(step)
    for sign in (1.0, -1.0, 1.0):
        x = sign * torch.arange(1.0, 5.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ptj.JitWarning)  # it may run eagerly, warned
            torch.testing.assert_close(jitted(x), step(x))
