"""Code the step reaches through containers, class attributes and its globals dict
(_reads._code_walk): functions in any container (a deque, an OrderedDict, a frozenset, a list
subclass) and past a registry's 32nd entry, partials, callable objects and tables of lambdas
kept on a class, and globals looked up by a name held in a variable (``globals()[WHICH]``,
``globals`` under another name). What that code reads is guarded: a change retraces. Each
case was found silently wrong by a probe of state-change programs (round 12)."""

from __future__ import annotations

import builtins
import collections
import functools
import sys
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from helpers import like_eager_then_retraced

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines

GAIN = 1.0
K1, K2 = 1.0, 2.0
WHICH = "K1"
NAMES = ["K1"]
ALIAS = globals


def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x * GAIN


class _Scaler:
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * GAIN


class _Listed(list):  # type: ignore[type-arg]
    pass


class _Ops:
    part = functools.partial(lambda x, k: x * k * GAIN, k=1.0)
    obj = _Scaler()
    table: ClassVar[dict[str, Any]] = {"f": lambda x: x * GAIN}


_MANY = [(lambda x, k=k: x + k) for k in range(40)]
_MANY[35] = _scaled
_HOLDERS: dict[str, Any] = {
    "deque": collections.deque([_scaled]),
    "OrderedDict": collections.OrderedDict(f=_scaled),
    "frozenset": frozenset([_scaled]),
    "list subclass": _Listed([_scaled]),
}

STEPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "deque": lambda x: _HOLDERS["deque"][0](x),
    "OrderedDict": lambda x: _HOLDERS["OrderedDict"]["f"](x),
    "frozenset": lambda x: next(iter(_HOLDERS["frozenset"]))(x),
    "list subclass": lambda x: _HOLDERS["list subclass"][0](x),
    "36th entry": lambda x: _MANY[35](x),
    "class partial": lambda x: _Ops.part(x),
    "class callable object": lambda x: _Ops.obj(x),
    "class table": lambda x: _Ops.table["f"](x),
}


@pytest.fixture
def gain() -> Any:
    global GAIN
    yield
    GAIN = 1.0


def _set_gain() -> None:
    global GAIN
    GAIN = 3.0


@pytest.mark.parametrize("case", list(STEPS))
def test_code_held_in_containers_and_on_classes_is_walked(case: str, gain: Any) -> None:
    step = STEPS[case]
    like_eager_then_retraced(ptj.jit(step), step, _set_gain)


def _by_variable(x: torch.Tensor) -> torch.Tensor:
    return x * globals()[WHICH]


def _by_list(x: torch.Tensor) -> torch.Tensor:
    return x * globals()[NAMES[0]]


def _by_module_dict(x: torch.Tensor) -> torch.Tensor:
    return x * vars(sys.modules[__name__])[WHICH]


def _by_renamed_globals(x: torch.Tensor) -> torch.Tensor:
    return x * ALIAS()["K1"] + builtins.globals()["K2"]


@pytest.mark.parametrize(
    "step", [_by_variable, _by_list, _by_module_dict, _by_renamed_globals], ids=lambda f: f.__name__
)
def test_a_global_looked_up_by_a_name_in_a_variable_is_guarded(step: Any) -> None:
    def change() -> None:
        global K1
        K1 = 10.0

    try:
        like_eager_then_retraced(ptj.jit(step), step, change)
    finally:
        globals()["K1"] = 1.0


def test_the_name_looked_up_is_guarded_and_the_new_global_read() -> None:
    jitted = ptj.jit(_by_variable)
    x = torch.ones(2)
    try:
        for change in ({}, {"WHICH": "K2"}, {"K2": 5.0}):  # K2 is read once WHICH names it
            globals().update(change)
            for _ in range(3):
                torch.testing.assert_close(jitted(x), _by_variable(x))
        assert jitted.num_traces == 3
    finally:
        globals().update(WHICH="K1", K2=2.0)


def test_globals_read_by_constant_names_only_guard_those() -> None:
    """``globals()["K1"]`` reads K1, not every global: another global changing keeps the
    program."""
    step = lambda x: x * globals()["K1"]  # noqa: E731
    jitted = ptj.jit(step)
    x = torch.ones(2)
    for _ in range(2):
        jitted(x)
    globals()["K2"] = 7.0
    try:
        torch.testing.assert_close(jitted(x), step(x))
        assert jitted.num_traces == 1
    finally:
        globals()["K2"] = 2.0
