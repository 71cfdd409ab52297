"""Stage 1 (reads): state of the user's that the step reaches through a library's or Python's
own code, not by a path its code spells (probe 48): a subclass tree walked recursively, what
``argparse`` parses from a parser's arguments, ``inspect.unwrap`` through several
``__wrapped__`` links, a ``datetime``'s ``tzinfo`` of the user's class; annotations read by
``typing.get_type_hints`` or ``inspect.signature``. Each change is made after the trace; every
engine must then return eager's values."""

from __future__ import annotations

import argparse
import datetime
import inspect
import typing
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import like_eager_after_each
from torch import nn

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines


def _like_eager(step: Callable[[torch.Tensor], torch.Tensor],
                changes: list[Callable[[], Any]]) -> None:  # fmt: skip
    x = torch.arange(1.0, 5.0)
    like_eager_after_each(ptj.jit(step), lambda f: f(x), step, changes)


def _tree(klass: type) -> list[type]:
    """``klass`` and every subclass under it, as a plugin registry walks them."""
    found = [klass]
    for sub in klass.__subclasses__():  # on a local: no path the walk could follow
        found += _tree(sub)
    return found


@pytest.mark.parametrize("base", [object, nn.Module], ids=["plain", "nn.Module"])
def test_a_subclass_tree_walked_recursively_is_guarded(base: type) -> None:
    """Only the direct subclass list of a class the code names was guarded: a grandchild
    defined after the trace, or one whose class attribute changed, was not seen."""

    class Term(base):  # type: ignore[misc, valid-type]
        K = 1.0

    class Middle(Term):
        K = 2.0

    class Leaf(Middle):
        K = 3.0

    def step(x: torch.Tensor) -> torch.Tensor:
        for klass in _tree(Term):
            x = x * klass.K
        return x

    kept: list[type] = []

    def define_a_grandchild() -> None:
        class Late(Leaf):
            K = 5.0

        kept.append(Late)

    _like_eager(step, [lambda: setattr(Leaf, "K", 7.0), define_a_grandchild])


def test_what_argparse_parses_from_a_parsers_arguments_is_guarded() -> None:
    """``parse_args()`` reads each argument's settings, kept on the ``Action`` objects
    ``add_argument`` returns: a default, a constant or a type replaced there was not seen."""
    parser = argparse.ArgumentParser()
    k = parser.add_argument("--k", type=float, default=2.0)
    on = parser.add_argument("--on", action="store_const", const=1.0, default=1.0)

    def step(x: torch.Tensor) -> torch.Tensor:
        parsed = parser.parse_args(["--on"])
        return x * parsed.k * parsed.on

    _like_eager(step, [lambda: setattr(k, "default", 3.0), lambda: setattr(on, "const", 4.0),
                       lambda: setattr(k, "type", lambda text: float(text) + 1)])  # fmt: skip


def test_a_function_unwrapped_through_several_links_is_guarded() -> None:
    """``inspect.unwrap`` follows ``__wrapped__`` past the first link, which alone was
    guarded: the second one replaced kept the first function."""

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2.0

    def triple(x: torch.Tensor) -> torch.Tensor:
        return x * 3.0

    def inner(x: torch.Tensor) -> torch.Tensor:
        return x

    def outer(x: torch.Tensor) -> torch.Tensor:
        return x

    inner.__wrapped__ = double  # type: ignore[attr-defined]
    outer.__wrapped__ = inner  # type: ignore[attr-defined]

    def step(x: torch.Tensor) -> torch.Tensor:
        return inspect.unwrap(outer)(x)

    _like_eager(step, [lambda: setattr(inner, "__wrapped__", triple)])


OFFSET_HOURS = [2]


class _Zone(datetime.tzinfo):
    def __init__(self) -> None:
        self.extra = 0

    def utcoffset(self, dt: datetime.datetime | None) -> datetime.timedelta:
        return datetime.timedelta(hours=OFFSET_HOURS[0] + self.extra)

    def dst(self, dt: datetime.datetime | None) -> datetime.timedelta | None:
        return None


def test_a_datetimes_tzinfo_of_yours_is_walked_and_guarded() -> None:
    """``DT.utcoffset()`` runs the tzinfo's method from C: neither the global it reads nor the
    tzinfo's own attribute was guarded."""
    moment = datetime.datetime(2020, 1, 1, tzinfo=_Zone())

    def step(x: torch.Tensor) -> torch.Tensor:
        offset = moment.utcoffset()
        assert offset is not None
        return x * (offset.total_seconds() / 3600)

    zone = moment.tzinfo
    assert isinstance(zone, _Zone)
    try:
        _like_eager(step, [lambda: OFFSET_HOURS.__setitem__(0, 3),
                           lambda: setattr(zone, "extra", 2)])  # fmt: skip
    finally:
        OFFSET_HOURS[0] = 2


def _scaled(x: torch.Tensor, k: float) -> torch.Tensor:
    return x * k


def test_annotations_read_by_get_type_hints_are_guarded() -> None:
    """``typing.get_type_hints(f)`` reads ``f.__annotations__``, which the step's code never
    spells as a path: an annotation changed in place, or the whole dict replaced, kept the
    traced branch (session 41's note)."""

    def step(x: torch.Tensor) -> torch.Tensor:
        hints = typing.get_type_hints(_scaled)
        return _scaled(x, 2.0 if hints["k"] is float else 3.0)

    def replace_all() -> None:
        _scaled.__annotations__ = {"x": "torch.Tensor", "k": "float", "return": "torch.Tensor"}

    kept = dict(_scaled.__annotations__)
    try:
        _like_eager(step, [lambda: _scaled.__annotations__.__setitem__("k", "int"), replace_all])
    finally:
        _scaled.__annotations__ = kept


def test_annotations_read_through_inspect_signature_are_guarded() -> None:
    """``inspect.signature(f).parameters[...].annotation``, of a local function and of a class
    the step reads (``typing.get_type_hints(Config)`` walks its class dict)."""

    def helper(x: torch.Tensor, k: float = 1.0) -> torch.Tensor:
        return x

    class Config:
        k: float = 1.0

    def step(x: torch.Tensor) -> torch.Tensor:
        annotation = inspect.signature(helper).parameters["k"].annotation
        hints = typing.get_type_hints(Config)
        x = x * (2.0 if annotation == "float" else 5.0)
        return x * (3.0 if hints["k"] is float else 7.0)

    _like_eager(step, [lambda: helper.__annotations__.__setitem__("k", "int"),
                       lambda: Config.__annotations__.__setitem__("k", int)])  # fmt: skip
