"""What a jitted callable holds and what its arguments change (_reads._held, _reads._fields,
_reads._mutations): the class of a jitted classmethod, a keyword added to a jitted partial, a
config object answering through ``__getattr__``, a ``functools.wraps`` wrapper's
``__wrapped__``, a callable argument that changes its own state. Each was found silently
wrong by a probe (the program kept what it had traced, or repeated a side effect)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import like_eager_then_retraced

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines


class _Base:
    K = 1.0


class _Sim(_Base):
    @classmethod
    def step(cls, x: torch.Tensor) -> torch.Tensor:
        return x * cls.K


def test_a_jitted_classmethod_sees_its_class_attributes() -> None:
    try:
        like_eager_then_retraced(ptj.jit(_Sim.step), _Sim.step, lambda: setattr(_Sim, "K", 4.0))
    finally:
        del _Sim.K
    try:  # inherited, changed on the base
        like_eager_then_retraced(ptj.jit(_Sim.step), _Sim.step, lambda: setattr(_Base, "K", 3.0))
    finally:
        _Base.K = 1.0


def _shifted(x: torch.Tensor, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return x * scale + shift


def test_a_keyword_added_to_a_jitted_partial_retraces() -> None:
    bound = functools.partial(_shifted, scale=2.0)
    like_eager_then_retraced(
        ptj.jit(bound), bound, lambda: bound.keywords.__setitem__("shift", 5.0)
    )


class _LookedUp:
    """A config whose values live in a dict, answered by ``__getattr__`` (a KeyError for a
    missing name, not an AttributeError)."""

    def __init__(self) -> None:
        self.__dict__["_values"] = {"alpha": 1.0}

    def __getattr__(self, name: str) -> Any:
        return self.__dict__["_values"][name]


class _Holder:
    def __init__(self) -> None:
        self.cfg = _LookedUp()

    def step(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.cfg.alpha


def test_a_config_answering_through_getattr_is_walked() -> None:
    holder = _Holder()
    change = lambda: holder.cfg._values.__setitem__("alpha", 9.0)  # noqa: E731
    like_eager_then_retraced(ptj.jit(holder.step), holder.step, change)


def _decorated(f: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(f)
    def wrapper(x: torch.Tensor) -> torch.Tensor:
        return wrapper.__wrapped__(x) + 1.0  # type: ignore[attr-defined]

    return wrapper


@_decorated
def _tripled(x: torch.Tensor) -> torch.Tensor:
    return x * 3


def test_a_wrappers_wrapped_function_swapped_retraces() -> None:
    original = _tripled.__wrapped__  # type: ignore[attr-defined]
    try:
        change = lambda: setattr(_tripled, "__wrapped__", lambda x: x * 9)  # noqa: E731
        like_eager_then_retraced(ptj.jit(_tripled), _tripled, change)
    finally:
        _tripled.__wrapped__ = original  # type: ignore[attr-defined]


class _Loader:
    def __init__(self) -> None:
        self.data = [float(k) for k in range(10)]
        self.k = 0

    def __call__(self) -> float:
        self.k += 1
        return self.data[self.k - 1]


def test_a_callable_argument_that_changes_its_state_runs_once_per_call() -> None:
    """Its counter is part of the key, so each call specialized again; the record and trace
    passes both ran it: every call advanced it twice, silently."""

    def step(x: torch.Tensor, loader: _Loader) -> torch.Tensor:
        return x * loader()

    jitted, mine, theirs = ptj.jit(step), _Loader(), _Loader()
    x = torch.ones(2)
    with pytest.warns(ptj.JitWarning, match="changes Python state"):
        for _ in range(3):
            torch.testing.assert_close(jitted(x, mine), step(x, theirs))
    assert mine.k == theirs.k == 3


class _Parent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = 2.0
        self.child = _Child(self)


class _Child(torch.nn.Module):
    def __init__(self, parent: _Parent) -> None:
        super().__init__()
        import weakref

        self.parent_ref = weakref.ref(parent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parent = self.parent_ref()
        assert parent is not None
        return x * parent.scale


def test_a_jitted_module_follows_its_weak_reference_to_a_parent() -> None:
    parent = _Parent()
    child = parent.child
    like_eager_then_retraced(ptj.jit(child), child, lambda: setattr(parent, "scale", 5.0))


class _Named:
    """Equal by name only; holds a dict its step reads."""

    def __init__(self, name: str, values: dict[str, float]) -> None:
        self.name, self.values = name, values

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Named) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


def test_arguments_equal_by_their_eq_holding_other_dicts_are_keyed_apart() -> None:
    def step(x: torch.Tensor, cfg: _Named) -> torch.Tensor:
        return x * cfg.values["k"]

    jitted, x = ptj.jit(step), torch.ones(3)
    a, b = _Named("a", {"k": 1.0}), _Named("a", {"k": 3.0})
    for cfg in (a, b, a, b):
        torch.testing.assert_close(jitted(x, cfg), step(x, cfg))
    a.values["k"] = 6.0  # in place
    torch.testing.assert_close(jitted(x, a), step(x, a))


_G = [1.0]


def _flux(x: torch.Tensor) -> torch.Tensor:
    return x * _G[0]


def _other_flux(x: torch.Tensor) -> torch.Tensor:
    return x * 5.0


class _Scheme:
    """Equal by name only; holds the function its step calls (or a class, a module)."""

    def __init__(self, name: str, flux: Any) -> None:
        self.name, self.flux = name, flux

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Scheme) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


class _SlottedScheme:
    __slots__ = ("flux", "name")

    def __init__(self, name: str, flux: Any) -> None:
        self.name, self.flux = name, flux

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SlottedScheme) and (other.name, other.flux) == (
            self.name, self.flux)  # fmt: skip

    def __hash__(self) -> int:
        return hash(self.name)


@pytest.mark.parametrize("kind", [_Scheme, _SlottedScheme])
@pytest.mark.parametrize("change", ["replaced", "an equal one", "its global", "in a dict"])
def test_an_argument_equal_by_its_eq_holding_a_function_is_keyed_and_walked(
    kind: type, change: str
) -> None:
    """An argument keyed by its ``__eq__`` and its plain attributes held a function the step
    calls: neither keyed (a function is callable, and only methods and partials were) nor
    walked (in slots too), so ``s.flux = other``, an equal object holding another function, or
    the function's global changed kept the first trace (probe 44a, every engine)."""
    _G[0] = 1.0
    scheme = kind("upwind", _flux)

    def step(x: torch.Tensor, s: Any) -> torch.Tensor:
        return (s["s"] if isinstance(s, dict) else s).flux(x)  # type: ignore[no-any-return]

    jitted, x = ptj.jit(step), torch.linspace(0.5, 1.5, 3)
    arguments = {"replaced": scheme, "an equal one": scheme, "its global": scheme,
                 "in a dict": {"s": scheme}}  # fmt: skip
    argument = arguments[change]
    for _ in range(3):
        torch.testing.assert_close(jitted(x, argument), step(x, argument))
    if change == "replaced":
        scheme.flux = _other_flux
    elif change == "an equal one" and kind is _Scheme:
        argument = kind("upwind", _other_flux)
    else:
        _G[0] = 3.0
    for _ in range(3):
        torch.testing.assert_close(jitted(x, argument), step(x, argument))
    _G[0] = 1.0


class _Counting:
    """A callable object a module holds, whose ``__call__`` changes its own state."""

    def __init__(self) -> None:
        self.k = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.k += 1
        return x * self.k


class _HoldsCounter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.counter = _Counting()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.counter(x)


class _CountsOnItsClass(torch.nn.Module):
    K = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).K += 1
        return x * type(self).K


@pytest.mark.parametrize("jitted_as", ["module", "step"])
def test_a_callable_object_a_module_holds_that_changes_its_state_runs_once_per_call(
    jitted_as: str,
) -> None:
    """Module attributes that were callable were skipped as code: the counter went 1, 2, 2, 2
    where eager counts on (found by a probe)."""
    mine, theirs = _HoldsCounter(), _HoldsCounter()
    jitted = ptj.jit(mine) if jitted_as == "module" else ptj.jit(lambda x: mine(x) + 0)
    x = torch.ones(2)
    with pytest.warns(ptj.JitWarning, match="counter.k"):
        for _ in range(4):
            torch.testing.assert_close(jitted(x) + 0, theirs(x))
    assert mine.counter.k == theirs.counter.k == 4


def test_a_forward_that_changes_its_class_attribute_runs_once_per_call() -> None:
    """``type(self).K += 1`` in the jitted module's own forward: its class was walked only for
    modules passed as arguments, so the record and trace passes both ran it (1, 3, 5, 7)."""
    jitted, before = ptj.jit(_CountsOnItsClass()), _CountsOnItsClass.K
    try:
        with pytest.warns(ptj.JitWarning, match="K"):
            results = [float(jitted(torch.ones(1))) for _ in range(4)]
        assert results == [before + 1.0, before + 2.0, before + 3.0, before + 4.0]
        assert _CountsOnItsClass.K == before + 4
    finally:
        _CountsOnItsClass.K = 0
