"""Objects that show what others hold (``_reads/_shown``): a dict's view held apart from its
dict, whose objects, arrays, tensors or iterators the walk did not reach, and a ``slice``
whose bound is an array or an object of yours. Each case was silently wrong on every engine
(probe round 42): the compiled program kept what the first call read."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch
from helpers import like_eager_then_retraced

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines


class _Term:
    def __init__(self, k: float) -> None:
        self.k = k


@pytest.mark.parametrize("view", ["values", "keys"])
def test_objects_in_a_held_view_are_guarded(view: str) -> None:
    """``for term in TERMS`` with ``TERMS = {"a": t, ...}.values()``, or the objects as the
    keys of a ``keys()`` view."""
    first = _Term(2.0)
    entries = {"a": first, "b": _Term(3.0)}
    terms = entries.values() if view == "values" else {t: n for n, t in entries.items()}.keys()

    def step(x: torch.Tensor) -> torch.Tensor:
        for term in terms:
            x = x * term.k + 1.0
        return x

    like_eager_then_retraced(ptj.jit(step), step, lambda: setattr(first, "k", 5.0))


def test_an_array_in_an_items_view_changed_in_place_retraces() -> None:
    coefficients = np.array([1.0, 2.0])
    items = {"c": coefficients}.items()

    def step(x: torch.Tensor) -> torch.Tensor:
        for _, array in items:
            x = x * float(array[0])
        return x

    like_eager_then_retraced(ptj.jit(step), step, lambda: coefficients.__setitem__(0, 4.0))


def test_an_iterator_or_a_tensor_in_a_held_view_runs_the_step_eagerly_warned() -> None:
    counters = {"n": itertools.count(1.0)}.values()
    weights = {"w": torch.ones(3)}
    shown = weights.values()

    def step(x: torch.Tensor) -> torch.Tensor:
        for counter in counters:
            x = x + next(counter)
        for w in shown:
            x = x * w
        return x

    jitted = ptj.jit(step)
    x = torch.linspace(0.5, 1.5, 3)
    with pytest.warns(ptj.JitWarning, match="eagerly"):
        jitted(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for n in range(2, 6):
            weights["w"] = torch.full((3,), float(n))
            expected = (x + n) * n
            torch.testing.assert_close(jitted(x), expected)


class _Stop:
    def __init__(self, n: int) -> None:
        self.n = n

    def __index__(self) -> int:
        return self.n


@pytest.mark.parametrize("bound", ["array", "object"])
def test_a_slices_bound_that_changes_in_place_retraces(bound: str) -> None:
    stop: np.ndarray | _Stop = np.array(2) if bound == "array" else _Stop(2)
    window = (slice(None), slice(0, stop))

    def step(x: torch.Tensor) -> torch.Tensor:
        return x[window] * 2.0

    def change() -> None:
        if isinstance(stop, np.ndarray):
            stop[...] = 3
        else:
            stop.n = 3

    x = torch.arange(8.0).reshape(2, 4)
    like_eager_then_retraced(ptj.jit(step), step, change, x=x)
