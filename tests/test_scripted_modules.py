"""Stage 5, TorchScript modules the step calls (``_scripted_modules``): their state lives in
C++ behind wrappers that are not dicts; what a trace bakes of it is compared all the same."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import phi_torch_jit as ptj
from phi_torch_jit._guards import ModuleGuard

pytestmark = pytest.mark.uses_torchscript  # the user's own TorchScript module


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.k = 2.0
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.k


def _scripted() -> torch.jit.ScriptModule:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*torch.jit.script")  # deprecated: torch 2.11+
        return torch.jit.script(_Scaled())


def test_the_guard_reads_a_scripted_modules_state_and_says_what_changed() -> None:
    module = _scripted()
    guard = ModuleGuard([module])
    assert guard.holds()
    module.k = 7.0
    assert not guard.holds()
    assert (
        guard.describe_change()
        == "TorchScript module RecursiveScriptModule: attribute k 2.0 -> 7.0"
    )
    module.k = 2.0
    assert guard.holds()
    with torch.no_grad():
        module.lin.weight.mul_(2.0)  # in place (an optimizer's step): the same state
    assert guard.holds()
    module.lin.bias = nn.Parameter(torch.zeros(3))
    assert not guard.holds()
    assert "lin: its parameters changed" in guard.describe_change()


@pytest.mark.all_engines
def test_a_scripted_modules_attribute_or_parameter_replaced_retraces_like_eager() -> None:
    """``s.k = 7.0`` (a float its TorchScript forward reads, a constant in the trace) was
    baked; ``s.lin.bias = nn.Parameter(...)`` crashed the guard (probe 43b)."""
    module = _scripted()
    jitted = ptj.jit(lambda x: module(x))
    x = torch.randn(2, 3)
    changes = [
        lambda: None,
        lambda: setattr(module, "k", 7.0),
        lambda: setattr(module.lin, "bias", nn.Parameter(torch.full((3,), 5.0))),
        lambda: module.eval(),
    ]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", ptj.JitWarning)  # engine torchscript: eager, warned
        for change in changes:
            change()
            for _ in range(2):
                torch.testing.assert_close(jitted(x), module(x))
    # each change retraced; engine torchscript cannot trace a call of a scripted module that
    # is not a submodule of its trace: eager throughout, said
    eager = "runs eagerly" in jitted.explain()
    assert (jitted.num_traces, eager) in ((4, False), (1, True)), jitted.explain()
