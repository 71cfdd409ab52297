"""What registries and binders hold, walked by the guard stage (_reads._fields): a
single-dispatch function's implementations, what a ``functools.partialmethod`` binds, a
``types.MappingProxyType``'s entries, a ``WeakKeyDictionary``'s values. Each case was found
silently wrong by a probe of state-change programs: the program kept what it had traced."""

from __future__ import annotations

import functools
import types
import weakref
from typing import Any

import pytest
import torch
from helpers import like_eager_then_retraced

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines


@functools.singledispatch
def _coefficient(v: Any) -> float:
    return 1.0


@_coefficient.register(float)
def _(v: float) -> float:
    return v * 2


def test_a_single_dispatch_implementation_replaced_for_the_same_type_retraces() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return x * _coefficient(1.5)

    before = _coefficient.dispatch(float)
    try:
        like_eager_then_retraced(
            ptj.jit(step), step, lambda: _coefficient.register(float, lambda v: v * 7)
        )
    finally:
        _coefficient.register(float, before)


class _Knob:
    def __init__(self) -> None:
        self.v = 2.0


class _Bound:
    knob = _Knob()

    def _scaled(self, t: torch.Tensor, k: _Knob, extra: list[float]) -> torch.Tensor:
        return t * k.v + extra[0]

    scaled = functools.partialmethod(_scaled, k=knob, extra=[0.0])


@pytest.mark.parametrize("change", ["attribute", "in place"])
def test_what_a_partialmethod_binds_is_guarded(change: str) -> None:
    holder = _Bound()

    def step(x: torch.Tensor) -> torch.Tensor:
        return holder.scaled(x)

    method = _Bound.__dict__["scaled"]
    before = (method.keywords["k"].v, list(method.keywords["extra"]))
    try:
        if change == "attribute":
            like_eager_then_retraced(
                ptj.jit(step), step, lambda: setattr(method.keywords["k"], "v", -3.0)
            )
        else:
            like_eager_then_retraced(
                ptj.jit(step), step, lambda: method.keywords["extra"].__setitem__(0, 5.0)
            )
    finally:
        method.keywords["k"].v, method.keywords["extra"][:] = before[0], before[1]


_BEHIND: dict[str, float] = {"a": 1.0}
_PROXY = types.MappingProxyType(_BEHIND)


@pytest.mark.parametrize("change", ["key added", "value changed"])
def test_a_mapping_proxy_sees_the_dict_behind_it(change: str) -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return x * _PROXY["a"] + _PROXY.get("b", 0.0)

    try:
        if change == "key added":
            like_eager_then_retraced(ptj.jit(step), step, lambda: _BEHIND.__setitem__("b", 2.0))
        else:
            like_eager_then_retraced(ptj.jit(step), step, lambda: _BEHIND.__setitem__("a", 3.0))
    finally:
        _BEHIND.clear()
        _BEHIND["a"] = 1.0


class _Key:
    pass


class _Settings:
    def __init__(self, gain: float) -> None:
        self.gain = gain


@pytest.mark.parametrize("change", ["attribute", "replaced"])
def test_the_values_a_weak_key_dictionary_holds_are_guarded(change: str) -> None:
    key = _Key()
    table: weakref.WeakKeyDictionary[_Key, _Settings] = weakref.WeakKeyDictionary()
    table[key] = _Settings(2.0)

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * table[key].gain

    if change == "attribute":
        like_eager_then_retraced(ptj.jit(step), step, lambda: setattr(table[key], "gain", 9.0))
    else:
        like_eager_then_retraced(
            ptj.jit(step), step, lambda: table.__setitem__(key, _Settings(6.0))
        )


class _Stage:
    def __init__(self, k: float) -> None:
        self.k = k


def test_objects_used_as_dict_keys_are_walked() -> None:
    """``for stage in STAGES: x = x * stage.k`` with the stages as a dict's keys."""
    first, second = _Stage(1.0), _Stage(2.0)
    stages = {first: "a", second: "b"}

    def step(x: torch.Tensor) -> torch.Tensor:
        for stage in stages:
            x = x * stage.k
        return x

    like_eager_then_retraced(ptj.jit(step), step, lambda: setattr(first, "k", 5.0))


def test_a_default_factorys_closure_is_guarded() -> None:
    import collections

    state = {"default": 1.0}
    table: collections.defaultdict[str, float] = collections.defaultdict(lambda: state["default"])

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * table.get("k", table.default_factory())  # type: ignore[misc]

    like_eager_then_retraced(ptj.jit(step), step, lambda: state.__setitem__("default", 4.0))
