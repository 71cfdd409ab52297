"""The replay cursor checks that tracing calls custom functions as recorded."""

from __future__ import annotations

import pytest
import torch
from helpers import Counter

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines


def _double(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


def _triple(x: torch.Tensor) -> torch.Tensor:
    return 3 * x


double = ptj.custom_gradient(_double, lambda i, o, g: (2 * g[0],))
triple = ptj.custom_gradient(_triple, lambda i, o, g: (3 * g[0],))


class Flaky:
    """Calls custom functions differently on its second run (record vs trace). It counts its
    runs in a ``Counter`` (test instrumentation no guard looks into): a count the guards saw
    change would make it run eagerly before any trace."""

    def __init__(self, second: str) -> None:
        self.counter = Counter()
        self.second = second

    @property
    def runs(self) -> int:
        return self.counter.forward

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.counter.forward += 1
        if self.runs == 1:
            return double(x)
        if self.second == "other":
            return triple(x)
        if self.second == "more":
            return double(double(x))
        return x * 2  # "fewer"


@pytest.mark.parametrize(
    ("second", "message"),
    [
        ("other", r"call #1 was _triple \(.*\), but the record pass called _double \(.*\) there"),
        ("more", r"_double .* call #2, but the record pass made only 1"),
        ("fewer", r"only 0 of 1 recorded custom-function calls .* _double"),
    ],
)
def test_divergent_trace_runs_eagerly_with_the_replay_diagnosis(second: str, message: str) -> None:
    flaky = Flaky(second)
    step = ptj.jit(flaky)
    with pytest.warns(ptj.JitWarning, match=message):
        assert torch.equal(step(torch.ones(2)), torch.full((2,), 2.0))  # the record pass's
    assert "runs eagerly: while tracing" in step.explain()
    runs = flaky.runs
    step(torch.ones(2))  # eager from now on: the Python runs, once per call
    assert flaky.runs == runs + 1


def test_replay_diagnosis_names_the_jitted_function() -> None:
    step = ptj.jit(Flaky("other"))
    with pytest.warns(ptj.JitWarning, match=r"Flaky .* runs eagerly: while tracing Flaky"):
        step(torch.ones(2))
