"""Stage 1 (reads), ``_reads/_callable_attributes``: what code sets on Python's callable objects
that are not functions (a ``functools.partial``, a ``staticmethod`` or ``classmethod`` object,
a ``cached_property``, an ``lru_cache`` wrapper) is guarded however the step reads it: with a
default (``getattr(P, "scale", 1.0)``), by ``hasattr``, through a local (``c = P.cfg``), or by
calling a function kept there. Probe 49 found each silently wrong on every engine."""

from __future__ import annotations

import functools
import itertools
import warnings
from typing import Any

import pytest
import torch
from helpers import like_eager_then_retraced

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


class _Holder:
    @staticmethod
    def static(x: torch.Tensor) -> torch.Tensor:
        return x

    @classmethod
    def klass(cls, x: torch.Tensor) -> torch.Tensor:
        return x

    @functools.cached_property
    def cached(self) -> float:
        return 1.0


@functools.cache
def _table() -> float:
    return 1.0


def _holders() -> dict[str, Any]:
    return {
        "partial": functools.partial(_same),
        "partialmethod": functools.partialmethod(_same),
        "staticmethod": vars(_Holder)["static"],
        "classmethod": vars(_Holder)["klass"],
        "cached_property": vars(_Holder)["cached"],
        "lru_cache": _table,
    }


@pytest.mark.parametrize("kind", list(_holders()))
@pytest.mark.parametrize("how", ["changed", "added later"])
def test_an_attribute_read_with_a_default_is_guarded(kind: str, how: str) -> None:
    holder = _holders()[kind]
    if how == "changed":
        holder.scale = 2.0
    else:
        vars(holder).pop("scale", None)

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * getattr(holder, "scale", 1.0)

    try:
        like_eager_then_retraced(ptj.jit(step), step, lambda: setattr(holder, "scale", 5.0))
    finally:
        vars(holder).pop("scale", None)


P = functools.partial(_same)


class _Config:
    k = 2.0


K = [2.0]


def _post(x: torch.Tensor) -> torch.Tensor:
    return x * K[0]


def test_a_flag_tested_with_hasattr_is_guarded() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return P(x) * (3.0 if hasattr(P, "flag") else 1.0)

    vars(P).pop("flag", None)
    try:
        like_eager_then_retraced(ptj.jit(step), step, lambda: setattr(P, "flag", True))
    finally:
        vars(P).pop("flag", None)


def test_an_object_and_a_function_kept_on_a_partial_are_walked() -> None:
    """``c = P.cfg; c.k`` changed in place; ``P.post``'s global changed in place."""
    P.cfg = _Config()
    P.post = _post

    def step(x: torch.Tensor) -> torch.Tensor:
        config = P.cfg
        return P.post(P(x)) * config.k

    try:
        like_eager_then_retraced(ptj.jit(step), step, lambda: setattr(P.cfg, "k", 5.0))
        like_eager_then_retraced(ptj.jit(step), step, lambda: K.__setitem__(0, 7.0))
    finally:
        K[0] = 2.0
        del P.cfg, P.post


def test_a_jitted_partial_reading_its_own_attribute() -> None:
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * getattr(jitted_one, "extra", 1.0)

    jitted_one = functools.partial(scaled)
    like_eager_then_retraced(
        ptj.jit(jitted_one), jitted_one, lambda: setattr(jitted_one, "extra", 4.0)
    )


def test_an_iterator_kept_on_a_partial_runs_eagerly_with_a_warning() -> None:
    """A compiled program would replay the traced item: the step runs eagerly, warned."""

    class Box:
        pass

    holder = functools.partial(_same)
    holder.box = Box()
    holder.box.it = itertools.count()

    def take(box: Any) -> int:
        return next(box.it)

    def step(x: torch.Tensor) -> torch.Tensor:
        return holder(x) + take(holder.box)

    jitted = ptj.jit(step)
    x = torch.zeros(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [jitted(x)[0].item() for _ in range(4)]
    assert got == [0.0, 1.0, 2.0, 3.0]
    assert any("iterator" in str(w.message) for w in caught)


class _Index:
    """An index whose value is its state: ``operator.index`` reads ``self.i``."""

    def __init__(self) -> None:
        self.i = 0

    def __index__(self) -> int:
        return self.i


_WEIGHTS = [2.0, 5.0, 7.0]


@pytest.mark.parametrize("how", ["item", "two items", "slice bound"])
def test_what_an_itemgetter_gets_by_is_guarded(how: str) -> None:
    """``operator.itemgetter`` shows its items only through ``__reduce__``: an object of yours
    among them (or a slice's bound) was not walked (probe 53a), on every engine."""
    import operator

    index = _Index()
    getter = {
        "item": operator.itemgetter(index),
        "two items": operator.itemgetter(0, index),
        "slice bound": operator.itemgetter(slice(0, index)),
    }[how]

    def step(x: torch.Tensor) -> torch.Tensor:
        got = getter(_WEIGHTS)
        return x * (got if how == "item" else sum(got))

    index.i = 1
    like_eager_then_retraced(ptj.jit(step), step, lambda: setattr(index, "i", 2))


class _Order:
    def __init__(self) -> None:
        self.reverse = False

    def compare(self, a: float, b: float) -> float:
        return (b - a) if self.reverse else (a - b)

    def __call__(self, value: float) -> float:
        return -value if self.reverse else value


@pytest.mark.parametrize("how", ["cmp_to_key(bound method)", "cmp_to_key(object)",
                                 "frompyfunc(object)", "frompyfunc(bound method)"])  # fmt: skip
def test_the_object_a_c_callable_holds_is_walked(how: str) -> None:
    """``functools.cmp_to_key(order.compare)`` and ``numpy.frompyfunc(order, 1, 1)`` hold a
    bound method or an object of yours without an attribute to reach it: its state
    (``order.reverse``) was not guarded (probe 53a). A plain function's globals were."""
    import numpy as np

    order = _Order()
    if how.startswith("cmp_to_key"):
        key = functools.cmp_to_key(order.compare if "bound" in how else _Comparer(order))

        def step(x: torch.Tensor) -> torch.Tensor:
            return x * sorted([3.0, 1.0, 2.0], key=key)[0]
    else:
        ufunc = np.frompyfunc(order.__call__ if "bound" in how else order, 1, 1)

        def step(x: torch.Tensor) -> torch.Tensor:
            return x * float(ufunc(2.0))

    like_eager_then_retraced(ptj.jit(step), step, lambda: setattr(order, "reverse", True))


class _Comparer:
    """A callable object comparing by an order of yours."""

    def __init__(self, order: _Order) -> None:
        self.order = order

    def __call__(self, a: float, b: float) -> float:
        return self.order.compare(a, b)
