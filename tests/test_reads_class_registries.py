"""Code of yours that a library or C keeps and calls for the step, which the step's code never
names (``_reads/_class_registries``): a function a library registered for your class (a pytree
node's flatten, a KL divergence), a ``ctypes`` callback, and what a library's context manager
gives a ``with`` block. Each case was silently wrong on every engine (probe round 42): the
compiled program kept the value the function read in the first call."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.machinery
import sys
import types
from collections.abc import Iterator

import pytest
import torch
import torch.utils._pytree as pytree
from helpers import like_eager_then_retraced
from torch.distributions import Normal, kl_divergence, register_kl

import phi_torch_jit as ptj
from phi_torch_jit._reads._class_registries import ctypes_held, registered_for

K = 2.0
SETTINGS = {"k": 2.0}


@pytest.fixture(autouse=True)
def _restored() -> Iterator[None]:
    global K
    yield
    K = 2.0
    SETTINGS["k"] = 2.0


def _set_k() -> None:
    global K
    K = 5.0


def _scaled(v: float) -> float:
    return v * K


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_double, ctypes.c_double)
CALLBACK = _CALLBACK(_scaled)


@pytest.mark.all_engines
def test_a_ctypes_callback_reading_a_global_is_walked() -> None:
    """``CB = CFUNCTYPE(...)(fn)``: C calls ``fn``, which reads ``K``."""
    step = lambda x: x * CALLBACK(1.0)  # noqa: E731
    like_eager_then_retraced(ptj.jit(step), step, _set_k)


def _from_settings(v: float) -> float:
    return v * SETTINGS["k"]


class _Operations(ctypes.Structure):
    _fields_ = [("scale", _CALLBACK)]


OPERATIONS = _Operations(_CALLBACK(_from_settings))


@pytest.mark.all_engines
def test_a_callback_in_a_ctypes_structures_field_is_walked() -> None:
    step = lambda x: x * OPERATIONS.scale(1.0)  # noqa: E731
    like_eager_then_retraced(ptj.jit(step), step, lambda: SETTINGS.update(k=5.0))


class _Pair:
    def __init__(self, a: float, b: float) -> None:
        self.a, self.b = a, b


USE_B = True


def _flatten(p: _Pair) -> tuple[list[float], None]:
    return ([p.a, p.b] if USE_B else [p.a]), None


def _unflatten(values: list[float], context: None) -> _Pair:
    return _Pair(values[0], values[-1])


pytree.register_pytree_node(_Pair, _flatten, _unflatten)
PAIR = _Pair(2.0, 3.0)


@pytest.mark.all_engines
def test_a_pytree_flatten_registered_for_your_class_is_walked() -> None:
    """torch keeps ``_flatten`` in its registry keyed by ``_Pair``; ``tree_leaves`` calls it."""
    global USE_B
    step = lambda x: x * sum(pytree.tree_leaves(PAIR))  # noqa: E731

    def change() -> None:
        global USE_B
        USE_B = False

    try:
        like_eager_then_retraced(ptj.jit(step), step, change)
    finally:
        USE_B = True


class _Gaussian(Normal):
    pass


@register_kl(_Gaussian, _Gaussian)
def _kl(p: _Gaussian, q: _Gaussian) -> torch.Tensor:
    return K * (p.loc - q.loc) ** 2


PRIOR = _Gaussian(torch.zeros(3), torch.ones(3))


@pytest.mark.all_engines
def test_a_kl_divergence_registered_for_your_classes_is_walked() -> None:
    """torch keeps ``_kl`` in a registry keyed by the pair of classes."""
    step = lambda x: kl_divergence(_Gaussian(x, torch.ones(3)), PRIOR)  # noqa: E731
    like_eager_then_retraced(ptj.jit(step), step, _set_k)


ENTERED = contextlib.nullcontext({"k": 2.0})


@pytest.mark.all_engines
def test_what_a_librarys_context_manager_enters_is_guarded() -> None:
    """``with ENTERED as d``: ``__enter__`` returns what the object holds; the code never
    spells it."""

    def step(x: torch.Tensor) -> torch.Tensor:
        with ENTERED as d:
            return x * d["k"]

    def change() -> None:
        ENTERED.enter_result = {"k": 5.0}

    try:
        like_eager_then_retraced(ptj.jit(step), step, change)
    finally:
        ENTERED.enter_result = {"k": 2.0}


def test_a_registry_is_found_when_it_is_filled_after_the_scan() -> None:
    """A library's module-level dict, empty when its module was scanned, then keyed by
    classes and by pairs of classes."""
    library = types.ModuleType("_ptj_test_registry_library")
    library.__spec__ = importlib.machinery.ModuleSpec(library.__name__, None)
    library.BY_CLASS = {}
    library.BY_PAIR = {}
    sys.modules[library.__name__] = library

    class Mine:
        pass

    def one(value: object) -> float:
        return 1.0

    def two(value: object) -> float:
        return 2.0

    try:
        assert registered_for(Mine) == []
        library.BY_CLASS[Mine] = one
        library.BY_PAIR[(Mine, int)] = two
        assert registered_for(Mine) == [one, two]
        assert two in registered_for(int) and one not in registered_for(int)
    finally:
        del sys.modules[library.__name__]


def test_ctypes_held_finds_the_function_behind_a_callback_and_nothing_elsewhere() -> None:
    assert _scaled in ctypes_held(CALLBACK)
    assert _from_settings in ctypes_held(OPERATIONS)
    assert ctypes_held(ctypes.c_double(1.0)) == []
    assert ctypes_held(_scaled) == []
