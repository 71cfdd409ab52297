"""Arguments written in place (NOTE [arguments written in place]): a value-guard failure
undoes the program's writes before anything else runs on the arguments, and arguments that
share memory are part of what a specialization was built for. Every engine, against eager."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from helpers import captures_graph

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines


def _jit_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, ptj.JitWarning)]


def increment_then_branch(x: torch.Tensor) -> torch.Tensor:
    x.add_(1)
    if bool(x.sum() > 0):
        return x * 2
    return x * -1


def test_a_branch_after_an_in_place_write_sees_the_write_once(jit_engine: str) -> None:
    """The compiled program wrote x, then its value guard failed: the record pass of the
    retrace (and each cached program tried after it) must see x as the caller passed it."""
    jitted = ptj.jit(increment_then_branch)
    for start in (1.0, 1.0, -5.0, 1.0, -5.0, 2.0):
        ours, theirs = torch.full((3,), start), torch.full((3,), start)
        torch.testing.assert_close(jitted(ours), increment_then_branch(theirs))
        torch.testing.assert_close(ours, theirs)  # written exactly once, as eagerly
    assert jitted.num_traces == 2
    (written,) = {s.written for s in jitted.specializations}
    assert written is not None and written.indices == (0,)


def test_functions_that_write_no_argument_carry_nothing_for_it() -> None:
    jitted = ptj.jit(lambda x: x * 2)
    jitted(torch.ones(3))
    assert all(s.written is None for s in jitted.specializations)


def scale_then_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x.mul_(2)
    return x + y


@pytest.mark.parametrize("second", ["same tensor", "a view of it"])
def test_an_argument_written_and_passed_twice_equals_eager(jit_engine: str, second: str) -> None:
    def pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x, x) if second == "same tensor" else (x, x[:])

    jitted = ptj.jit(scale_then_add)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for shared in (False, True, True, False, True):
            ours, theirs = torch.ones(3), torch.ones(3)
            args: Any = pair(ours) if shared else (ours, torch.ones(3))
            want: Any = pair(theirs) if shared else (theirs, torch.ones(3))
            torch.testing.assert_close(jitted(*args), scale_then_add(*want))
            torch.testing.assert_close(ours, theirs)
    ours_warned = _jit_warnings(caught)
    if captures_graph(jit_engine):  # a captured graph reads the arguments as separate ones
        assert len(ours_warned) == 1
        assert "writes an argument in place (tensor argument 0" in ours_warned[0]
        assert "shares memory with another argument" in ours_warned[0]
    else:  # TorchScript runs the writes on the arguments' memory, in order
        assert not ours_warned
    assert jitted.num_traces == 2  # one specialization per way of sharing, each reused
