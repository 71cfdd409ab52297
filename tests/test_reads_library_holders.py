"""Stage 1 (reads), ``_reads/_library_holders``: values of yours kept on a library's module,
class or object, read other than by a path the step's code spells from a global: with a
default (``getattr(json, "gain", 1.0)``), through ``vars()``, tested with ``hasattr`` (set
later), or on a class handed to a helper, held in a list, bound by a partial, read by an
``attrgetter``; and a static method of yours on a library class, replaced. Probe 50 found each
silently wrong on every engine; the same value spelled ``json.gain`` was guarded."""

from __future__ import annotations

import functools
import json
import operator
from typing import Any

import numpy as np
import pytest
import torch
from helpers import like_eager_then_retraced
from torch import nn

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines


def _gain_of(klass: Any) -> float:
    return float(klass.gain)


def _rule_of(klass: Any) -> float:
    return float(klass.rule())


CLASSES = [json.JSONDecoder, nn.Linear]
BOUND = functools.partial(_gain_of, json.JSONDecoder)
GAIN = operator.attrgetter("gain")
NAME = "gain"
DECODER = json.JSONDecoder()


def _two() -> float:
    return 2.0


def _five() -> float:
    return 5.0


STEPS = {
    "getattr default": lambda x: x * getattr(json, "gain", 1.0),
    "vars().get": lambda x: x * vars(json).get("gain", 1.0),
    "hasattr, set later": lambda x: x * (2.0 if hasattr(torch, "ptj_test_flag") else 3.0),
    "class handed to a helper": lambda x: x * _gain_of(torch.nn.Linear),
    "classes in a list": lambda x: x * sum(c.gain for c in CLASSES),
    "class bound by a partial": lambda x: x * BOUND(),
    "attrgetter on a module": lambda x: x * GAIN(json),
    "static method of yours": lambda x: x * _rule_of(torch.nn.Linear),
    "a name held in a variable": lambda x: x * getattr(json, NAME, 1.0),
    "an instance's class attribute": lambda x: x * _gain_of(DECODER),
}


@pytest.mark.parametrize("how", list(STEPS))
def test_a_value_of_yours_on_a_librarys_holder_is_guarded(how: str, monkeypatch: Any) -> None:
    step = STEPS[how]
    for holder in (json, json.JSONDecoder, nn.Linear):
        monkeypatch.setattr(holder, "gain", 2.0, raising=False)
    monkeypatch.setattr(nn.Linear, "rule", staticmethod(_two), raising=False)
    monkeypatch.delattr(torch, "ptj_test_flag", raising=False)

    def change() -> None:
        for holder in (json, json.JSONDecoder, nn.Linear):
            monkeypatch.setattr(holder, "gain", 5.0)
        monkeypatch.setattr(nn.Linear, "rule", staticmethod(_five))
        monkeypatch.setattr(torch, "ptj_test_flag", True, raising=False)

    like_eager_then_retraced(ptj.jit(step), step, change)


@pytest.mark.parametrize("kind", ["Polynomial", "poly1d"])
def test_a_numpy_array_inside_a_librarys_object_changed_in_place_retraces(kind: str) -> None:
    """A library's object holding a small NumPy array, called by the step (a polynomial's
    coefficients; a NumPy-backed PhiML field's data, computed on by PhiML): compared by
    content (probe 52; the call of a ``poly1d`` was a documented limitation)."""
    poly = np.polynomial.Polynomial([1.0, 2.0]) if kind == "Polynomial" else np.poly1d([2.0, 1.0])
    coefficients = poly.coef if kind == "Polynomial" else poly.coeffs

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * float(poly(2.0))

    like_eager_then_retraced(ptj.jit(step), step, lambda: coefficients.__setitem__(0, 5.0))
