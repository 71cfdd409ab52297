"""State around the call that is not a variable of the step's (stage 0 keys and the guard stage):
inference mode and inference-tensor arguments, deterministic algorithms (part of the cache
key, as the grad mode is), ``parametrize.cached()``, an environment reader held under another
name,
and the order of a dict whose values are objects (guarded). Each case was found silently wrong
by a probe of state-change programs (round 13): the program kept what it had traced."""

from __future__ import annotations

import os
from collections.abc import Callable
from os import getenv as _env
from typing import Any

import pytest
import torch
from helpers import like_eager_then_retraced

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines


def _by_mode(x: torch.Tensor) -> torch.Tensor:
    return x * (2.0 if torch.is_inference_mode_enabled() else 3.0)


def test_inference_mode_and_no_grad_get_their_own_programs() -> None:
    jitted = ptj.jit(_by_mode)
    for _ in range(2):
        for mode in (torch.no_grad, torch.inference_mode, torch.no_grad):
            with mode():
                torch.testing.assert_close(jitted(torch.ones(2)), _by_mode(torch.ones(2)))
    assert jitted.num_traces == 2


def _written(x: torch.Tensor) -> torch.Tensor:
    x.add_(1)
    return x * 2


def test_an_inference_tensor_argument_gets_its_own_program() -> None:
    """Written in place outside inference mode, an inference tensor makes eager raise, and
    the jitted call raises alike (probe round 13 saw engine "compile" serve it the ordinary
    tensors' program, which wrote it; on de5cdaf this test passes too: the key's effect is
    shown by ``test_inference_mode_and_no_grad_get_their_own_programs``)."""
    jitted = ptj.jit(_written)
    for _ in range(2):
        torch.testing.assert_close(jitted(torch.ones(2)), _written(torch.ones(2)))
    with torch.inference_mode():
        mine, theirs = torch.ones(2), torch.ones(2)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"[Ii]nference"):
            _written(theirs)
        with pytest.raises(RuntimeError, match=r"[Ii]nference"):
            jitted(mine)
    torch.testing.assert_close(mine, theirs)  # (torch writes, then raises)


def _by_flags(x: torch.Tensor) -> torch.Tensor:
    return x * (2.0 if torch.are_deterministic_algorithms_enabled() else 3.0)


def test_deterministic_algorithms_are_part_of_the_key() -> None:
    try:
        like_eager_then_retraced(
            ptj.jit(_by_flags), _by_flags, lambda: torch.use_deterministic_algorithms(True)
        )
    finally:
        torch.use_deterministic_algorithms(False)


class _Doubled(torch.nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * 2.0


def test_calls_inside_parametrize_cached_run_eagerly_as_eager_code_caches() -> None:
    """Probe 39c: inside ``with parametrize.cached():`` eager code reuses the parametrized
    weight it computed first in the block, also after the original is changed in place; a
    compiled program computed it anew. Such calls get a key of their own and run eagerly,
    with one JitWarning saying why; outside the block the compiled program serves again."""
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 3)
    parametrize.register_parametrization(layer, "weight", _Doubled())
    jitted, x = ptj.jit(layer), torch.ones(3)
    for _ in range(3):
        torch.testing.assert_close(jitted(x), layer(x))
        jitted.wait_compiled()
    with parametrize.cached(), pytest.warns(ptj.JitWarning, match=r"parametrize\.cached"):
        expected = layer(x)  # the cache is filled here
        with torch.no_grad():
            layer.parametrizations.weight.original.add_(1.0)
        torch.testing.assert_close(jitted(x), layer(x))  # the cached weight, as eagerly
        torch.testing.assert_close(jitted(x), expected)
    torch.testing.assert_close(jitted(x), layer(x))  # the weight computed anew
    assert jitted.num_traces == 2  # the program, and the block's eager specialization


_GETTERS = {"env": os.getenv}


def _aliased(x: torch.Tensor) -> torch.Tensor:
    return x * float(_env("PTJ_TEST_SCALE", "1"))


def _in_a_table(x: torch.Tensor) -> torch.Tensor:
    return x * float(_GETTERS["env"]("PTJ_TEST_SCALE", "1"))


def _as_a_default(x: torch.Tensor, get: Callable[..., Any] = os.getenv) -> torch.Tensor:
    return x * float(get("PTJ_TEST_SCALE", "1"))


@pytest.mark.parametrize("step", [_aliased, _in_a_table, _as_a_default], ids=lambda f: f.__name__)
def test_the_environment_read_through_a_renamed_getenv_is_guarded(step: Any) -> None:
    try:
        like_eager_then_retraced(ptj.jit(step), step, lambda: os.environ.update(PTJ_TEST_SCALE="3"))
    finally:
        os.environ.pop("PTJ_TEST_SCALE", None)


class _Term:
    def __init__(self, c: float) -> None:
        self.c = c


TERMS: dict[str, Any] = {}


@pytest.mark.parametrize(
    "values",
    [
        lambda: {"a": torch.tensor(1.0), "b": torch.tensor(2.0)},
        lambda: {"a": _Term(1.0), "b": _Term(2.0)},
        lambda: {"a": lambda x: x + 1.0, "b": lambda x: x + 2.0},
    ],
    ids=["tensors", "objects", "functions"],
)
def test_a_dict_reordered_in_place_retraces(values: Callable[[], dict[str, Any]]) -> None:
    """``TERMS["a"] = TERMS.pop("a")``: same keys and values, another order, which a loop over
    the values follows (guarded per key before, not the order)."""

    def step(x: torch.Tensor) -> torch.Tensor:
        for term in TERMS.values():
            x = x * 0.5 + (term(0.0) if callable(term) else getattr(term, "c", term))
        return x

    TERMS.clear()
    TERMS.update(values())
    like_eager_then_retraced(ptj.jit(step), step, lambda: TERMS.update(a=TERMS.pop("a")))
