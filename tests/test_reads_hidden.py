"""State the step reaches through objects that hide it or run code to show it (_reads):
the arguments an ``operator.methodcaller`` binds, the function behind ``functools.cmp_to_key``,
a bound method over a partial, the order of an object's or a class's attributes (a loop over
``vars(cfg)``), and properties, ``__getattr__`` and ``__getitem__`` of the user's classes, which
the guard must not run. Each case was found by a probe of state-change programs (round 15):
silently wrong, or, for code that counts its reads, run seven more times a call."""

from __future__ import annotations

import abc
import collections
import contextlib
import ctypes
import enum
import functools
import operator
import sys
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from helpers import like_eager_then_retraced

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines

COEFFS = [1.0]
SIGN = 1.0


class _Picker:
    def pick(self, coeffs: list[float], scale: list[float] | None = None) -> float:
        return coeffs[0] * (scale or [1.0])[0]


PICKER = _Picker()
BY_ARGS = operator.methodcaller("pick", COEFFS)
BY_KEYWORDS = operator.methodcaller("pick", [1.0], scale=COEFFS)


def _compare(a: float, b: float) -> int:
    return int(a * SIGN > b * SIGN) - int(a * SIGN < b * SIGN)


BY_ORDER = functools.cmp_to_key(_compare)
SETTINGS = types.SimpleNamespace(k=1.0)
BOUND_PARTIAL = types.MethodType(functools.partial(lambda self, x, b: x * self.k * b[0], b=COEFFS),
                                 SETTINGS)  # fmt: skip

STEPS = {
    "methodcaller's arguments": lambda x: x * BY_ARGS(PICKER),
    "methodcaller's keywords": lambda x: x * BY_KEYWORDS(PICKER),
    "a partial of a methodcaller": lambda x: x * functools.partial(BY_ARGS)(PICKER),
    "cmp_to_key's function": lambda x: x * sorted([3.0, 1.0, 2.0], key=BY_ORDER)[0],
    "a bound method over a partial": lambda x: BOUND_PARTIAL(x),
}


def _change() -> None:
    global SIGN
    COEFFS[0] = 3.0
    SIGN = -1.0


@pytest.fixture
def restore() -> Any:
    global SIGN
    yield
    COEFFS[0], SIGN = 1.0, 1.0


@pytest.mark.parametrize("case", list(STEPS))
def test_what_a_callable_of_the_standard_library_holds_is_guarded(case: str, restore: Any) -> None:
    step = STEPS[case]
    like_eager_then_retraced(ptj.jit(step), step, _change)


class _Settings:
    def __init__(self) -> None:
        self.a, self.b = 2.0, 3.0


SET = _Settings()


class _Table:
    a = 2.0
    b = 3.0


def _over_an_objects_attributes(x: torch.Tensor) -> torch.Tensor:
    for value in vars(SET).values():
        x = x * value + 1
    return x


def _over_a_classs_attributes(x: torch.Tensor) -> torch.Tensor:
    for name, value in vars(_Table).items():
        if not name.startswith("_"):
            x = x * value + 1
    return x


def _reorder_object() -> None:
    a = SET.a
    del SET.a
    SET.a = a  # the same names and values, in another order


def _reorder_class() -> None:
    a = _Table.a
    del _Table.a
    _Table.a = a


@pytest.mark.parametrize(
    ("step", "reorder"),
    [(_over_an_objects_attributes, _reorder_object), (_over_a_classs_attributes, _reorder_class)],
    ids=["object", "class"],
)
def test_a_loop_over_attributes_sees_their_order(step: Any, reorder: Any) -> None:
    try:
        like_eager_then_retraced(ptj.jit(step), step, reorder)
    finally:
        SET.__dict__.clear()
        SET.a, SET.b = 2.0, 3.0
        del _Table.a, _Table.b
        _Table.a, _Table.b = 2.0, 3.0


class _Counting:
    """Code that counts its reads: a schedule advancing, a hit counter."""

    def __init__(self) -> None:
        self.reads = 0

    @property
    def rate(self) -> float:
        self.reads += 1
        return float(self.reads)

    def __getattr__(self, name: str) -> float:
        if name.startswith("_"):
            raise AttributeError(name)
        self.__dict__["reads"] += 1
        return float(self.reads)

    def __getitem__(self, key: str) -> float:
        self.reads += 1
        return float(self.reads)

    def _tick(self) -> float:
        self.reads += 1
        return float(self.reads)

    @property
    def through_an_alias(self) -> float:  # no store, no method call spelled: it changes
        tick = self._tick  # state all the same (probe round 19)
        return tick()

    @property
    def through_getattr(self) -> float:
        return float(getattr(self, "_tick")())  # noqa: B009

    @property
    def through_map(self) -> float:
        return sum(map(lambda _: self._tick(), [0]))


COUNTING = _Counting()
READS = {
    "a property": lambda x: x * COUNTING.rate,
    "__getattr__": lambda x: x * COUNTING.dt,
    "__getitem__": lambda x: x * COUNTING["dt"],
    "a method kept in a variable": lambda x: x * COUNTING.through_an_alias,
    "getattr(...)()": lambda x: x * COUNTING.through_getattr,
    "map over a method": lambda x: x * COUNTING.through_map,
}


@pytest.mark.parametrize("case", list(READS))
def test_code_of_yours_answering_a_read_runs_once_per_call_as_eagerly(case: str) -> None:
    """The step changes state (eager, warned), and the guard never runs the read: call i
    sees i reads, as eagerly."""
    step = READS[case]
    COUNTING.reads = 0
    jitted = ptj.jit(step)
    with pytest.warns(ptj.JitWarning, match="changes Python state"):
        for i in range(1, 5):
            torch.testing.assert_close(jitted(torch.ones(2)), torch.full((2,), float(i)))
    assert COUNTING.reads == 4


class _Config:
    """A config answering through ``__getattr__`` from a dict, without side effects."""

    def __init__(self) -> None:
        self._values = {"dt": 0.5}

    def __getattr__(self, name: str) -> float:
        try:
            return self.__dict__["_values"][name]
        except KeyError:
            raise AttributeError(name) from None


CONFIG = _Config()


def test_a_config_answering_through_getattr_is_guarded_by_what_it_holds() -> None:
    step = lambda x: x * CONFIG.dt  # noqa: E731

    def change() -> None:
        CONFIG._values["dt"] = 2.0

    try:
        like_eager_then_retraced(ptj.jit(step), step, change)
    finally:
        CONFIG._values["dt"] = 0.5


class _Schedule:
    """A property that only reads, here a library object's state (an optimizer's rate)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) * 2


SCHEDULE = _Schedule(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))


def test_a_property_that_only_reads_is_compared_by_the_guard() -> None:
    """The guard runs it and compares its value: the optimizer's rate, which no walk into a
    library's object reaches, is seen (not running properties at all missed it)."""
    step = lambda x: x * SCHEDULE.lr  # noqa: E731
    groups = SCHEDULE.optimizer.param_groups

    def change() -> None:
        groups[0]["lr"] = 0.5

    try:
        like_eager_then_retraced(ptj.jit(step), step, change)
    finally:
        groups[0]["lr"] = 0.1


K_1 = 2.0


def _over_the_modules_globals(x: torch.Tensor) -> torch.Tensor:
    for name, value in list(globals().items()):
        if name.startswith("K_"):
            x = x * value + 1
    return x


def test_a_loop_over_the_modules_globals_reads_each_and_sees_one_defined_later() -> None:
    """``for name, value in globals().items()`` reads every global: each is guarded, and how
    many there are (a ``K_2`` defined later retraces)."""
    jitted = ptj.jit(_over_the_modules_globals)
    x = torch.ones(2)
    try:
        for change in ({}, {"K_1": 3.0}, {"K_2": 5.0}):
            globals().update(change)
            for _ in range(2):
                torch.testing.assert_close(jitted(x), _over_the_modules_globals(x))
        assert jitted.num_traces == 3
    finally:
        globals()["K_1"] = 2.0
        globals().pop("K_2", None)


def test_a_loop_over_the_modules_globals_sees_their_order() -> None:
    """A global deleted and defined again is last in the loop's order: the names and values
    are the same, the order is not (probe 54 found it silently wrong on every engine)."""
    jitted = ptj.jit(_over_the_modules_globals)
    x = torch.ones(2)
    globals()["K_2"] = 5.0
    try:
        for _ in range(2):
            torch.testing.assert_close(jitted(x), _over_the_modules_globals(x))
        del globals()["K_1"]
        globals()["K_1"] = 2.0  # now after K_2
        for _ in range(2):
            torch.testing.assert_close(jitted(x), _over_the_modules_globals(x))
        assert jitted.num_traces == 2
    finally:
        globals().pop("K_2", None)


def test_a_loop_over_a_modules_namespace_sees_its_order() -> None:
    """``for name, v in vars(settings).items()`` over a module of yours: its names' order is
    guarded, as an object's ``vars()`` order is (probe 54)."""
    import types

    settings = types.ModuleType("settings_in_order")
    settings.A, settings.B = 1.0, 2.0  # type: ignore[attr-defined]

    def step(x: torch.Tensor) -> torch.Tensor:
        for name, value in vars(settings).items():
            if name in ("A", "B"):
                x = x * 0.5 + value
        return x

    def change() -> None:
        del settings.A
        settings.A = 1.0  # type: ignore[attr-defined]

    like_eager_then_retraced(ptj.jit(step), step, change)


def test_an_mmap_read_as_configuration_is_guarded_by_what_it_holds() -> None:
    import mmap
    import struct

    held = mmap.mmap(-1, 8)
    held[:] = struct.pack("d", 2.0)
    step = lambda x: x * struct.unpack_from("d", held)[0]  # noqa: E731

    def change() -> None:
        held[:] = struct.pack("d", 7.0)

    try:
        like_eager_then_retraced(ptj.jit(step), step, change)
    finally:
        held.close()


SCALE = 1.0


def _scale_by_the_global(t: torch.Tensor) -> torch.Tensor:
    return t * SCALE


def _default_lambda(x: torch.Tensor, op: Any = lambda t: t * SCALE) -> torch.Tensor:
    return op(x)  # type: ignore[no-any-return]


def _default_function(x: torch.Tensor, *, op: Any = _scale_by_the_global) -> torch.Tensor:
    return op(x)  # type: ignore[no-any-return]


class _Scaled(contextlib.ContextDecorator):
    """A context manager of yours used as a decorator: ``__enter__`` reads its state."""

    def __init__(self) -> None:
        self.k = 1.0

    def __enter__(self) -> _Scaled:
        _CURRENT.append(self.k * SCALE)
        return self

    def __exit__(self, *exc: object) -> None:
        _CURRENT.pop()


_CURRENT = [1.0]
_AROUND = _Scaled()


@contextlib.contextmanager
def _scaled_by_the_global() -> Any:
    _CURRENT.append(SCALE)
    try:
        yield
    finally:
        _CURRENT.pop()


@_AROUND
def _decorated_by_an_object(x: torch.Tensor) -> torch.Tensor:
    return x * _CURRENT[-1]


@_scaled_by_the_global()
def _decorated_by_a_generator(x: torch.Tensor) -> torch.Tensor:
    return x * _CURRENT[-1]


class _Point(NamedTuple):
    a: float = 1.0


CALLEES = {
    "a lambda as a default value": _default_lambda,
    "a function as a keyword-only default": _default_function,
    "a ContextDecorator object around a helper": lambda x: _decorated_by_an_object(x),
    "the jitted function decorated by one": _decorated_by_an_object,
    "a @contextmanager used as a decorator": lambda x: _decorated_by_a_generator(x),
    "a namedtuple's defaults": lambda x: x * _Point().a,
}


def _change_the_callees() -> None:
    global SCALE
    SCALE = 3.0
    _Point.__new__.__defaults__ = (3.0,)


@pytest.mark.parametrize("case", list(CALLEES))
def test_code_held_by_defaults_decorators_and_namedtuples_is_walked(case: str) -> None:
    """Found by probe round 16: code held as a parameter's default value, a context manager
    of the standard library's decorators, a namedtuple's defaults set on its ``__new__``."""
    global SCALE
    step = CALLEES[case]
    try:
        like_eager_then_retraced(ptj.jit(step), step, _change_the_callees)
    finally:
        SCALE = 1.0
        _Point.__new__.__defaults__ = (1.0,)


class _Parent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = 1.0
        self.offset = torch.zeros(3)


class _Child(torch.nn.Module):
    def __init__(self, parent: torch.nn.Module) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        object.__setattr__(self, "parent", parent)  # a back-reference, not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parent: Any = self.parent
        return self.lin(x) * parent.gain + parent.offset + (1.0 if parent.training else 0.0)


def test_a_module_held_apart_from_its_submodules_is_guarded() -> None:
    """A child's reference to its parent set with ``object.__setattr__``: the parent's
    attributes and mode were guarded by neither the module guard nor the walk."""
    parent = _Parent()
    child = _Child(parent)
    step = lambda x: child(x)  # noqa: E731

    def change() -> None:
        parent.gain = 3.0
        parent.offset = torch.ones(3)
        parent.eval()

    like_eager_then_retraced(ptj.jit(step), step, change, x=torch.randn(2, 3))


def test_a_lazy_modules_first_call_initializes_it_as_eagerly() -> None:
    """``nn.LazyLinear`` before its first call: the record pass asked its uninitialized
    parameter for its storage (a ValueError)."""
    x = torch.randn(4, 3)

    def run(jitted: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.LazyLinear(2))
        step = ptj.jit(lambda t: model(t)) if jitted else (lambda t: model(t))
        return [step(x) for _ in range(3)], torch.rand(2)

    (eager, after_eager), (jitted, after_jitted) = run(False), run(True)
    for e, j in zip(eager, jitted, strict=True):
        torch.testing.assert_close(j, e)
    torch.testing.assert_close(after_jitted, after_eager)  # the same draws, as many


class _Damper:
    def __init__(self) -> None:
        self.gamma = 1.0

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


DAMPER = _Damper()
WEAK_APPLY = weakref.WeakMethod(DAMPER.apply)


def _through_a_weak_method(x: torch.Tensor) -> torch.Tensor:
    apply = WEAK_APPLY()
    assert apply is not None
    return apply(x)


def _over_the_class_namespace(x: torch.Tensor) -> torch.Tensor:
    for name, value in _Table.__dict__.items():
        if not name.startswith("_"):
            x = x * value + 1
    return x


def _weaker_damping() -> None:
    DAMPER.gamma = 3.0


@pytest.mark.parametrize(
    ("step", "change"),
    [(_through_a_weak_method, _weaker_damping), (_over_the_class_namespace, _reorder_class)],
    ids=["WeakMethod", "K.__dict__"],
)
def test_reads_that_make_a_new_object_each_time_compile_and_are_guarded(
    step: Any, change: Any
) -> None:
    """A ``WeakMethod`` makes a new bound method on each call, ``K.__dict__`` a new proxy:
    both were taken for state the step changes (eager, warned); what they show is guarded."""
    try:
        like_eager_then_retraced(ptj.jit(step), step, change)
    finally:
        DAMPER.gamma = 1.0
        del _Table.a, _Table.b
        _Table.a, _Table.b = 2.0, 3.0


LAST: Any = None


def _keeps_its_last_output(x: torch.Tensor) -> torch.Tensor:
    global LAST
    y = x * 2
    LAST = y.detach()  # stored, never read by the step
    return y + 1


def _sets_its_last_output(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    setattr(sys.modules[__name__], "LAST", y.detach())  # noqa: B010
    return y + 1


@pytest.mark.parametrize("step", [_keeps_its_last_output, _sets_its_last_output])
def test_a_global_the_step_only_stores_is_state_it_changes(step: Any) -> None:
    """``global LAST; LAST = y.detach()``, ``setattr(sys.modules[__name__], "LAST", y)``:
    compiled calls skipped the store (LAST kept the first call's value, found by probe round
    17). The record pass now compares it: the step runs eagerly, warned, and stores it on
    every call."""
    jitted = ptj.jit(step)
    with pytest.warns(ptj.JitWarning, match="LAST"):
        for i in range(4):
            x = torch.full((2,), float(i))
            jitted(x)
            torch.testing.assert_close(LAST, x * 2)


class _Part(enum.Enum):
    A = 1
    B = 2


def _parts() -> dict[Any, types.SimpleNamespace]:
    return {_Part.A: types.SimpleNamespace(k=1.0), (1, "b"): types.SimpleNamespace(k=2.0)}


PARTS = _parts()


def _by_enum_and_tuple_keys(x: torch.Tensor) -> torch.Tensor:
    return x * PARTS[_Part.A].k + PARTS[(1, "b")].k


def _replace_parts() -> None:
    PARTS[_Part.A] = types.SimpleNamespace(k=5.0)
    PARTS[(1, "b")].k = 7.0


OPTIMIZER = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)


def _scaled_by_each_groups_rate(x: torch.Tensor) -> torch.Tensor:
    for group in OPTIMIZER.param_groups:
        x = x * group["lr"]
    return x


def _decay() -> None:
    OPTIMIZER.param_groups[0]["lr"] = 0.05


MASKED = np.ma.masked_array([1.0, 2.0], mask=[False, True], fill_value=0.0)
COUNT = 1.0
TIMES_COUNT = np.frompyfunc(lambda v: v * COUNT, 1, 1)


def _filled(x: torch.Tensor) -> torch.Tensor:
    return x * float(MASKED.filled()[1])


def _through_a_ufunc_of_yours(x: torch.Tensor) -> torch.Tensor:
    return x * float(TIMES_COUNT(2.0))


def _refill_and_count() -> None:
    global COUNT
    MASKED.fill_value = 9.0
    COUNT = 3.0


NESTED = torch.distributions.Independent(
    torch.distributions.Normal(torch.zeros(2), torch.ones(2)), 1
)


def _nested_distribution(x: torch.Tensor) -> torch.Tensor:
    return NESTED.log_prob(x) + NESTED.base_dist.mean.sum()


def _rescale() -> None:
    NESTED.base_dist.scale = torch.full((2,), 2.0)
    NESTED.base_dist.loc.add_(1.0)


STATE_CASES = {
    "values under enum and tuple keys": (_by_enum_and_tuple_keys, _replace_parts),
    "an optimizer's rate, looped over": (_scaled_by_each_groups_rate, _decay),
    "a masked array's fill value": (_filled, _refill_and_count),
    "a NumPy ufunc of yours": (_through_a_ufunc_of_yours, _refill_and_count),
    "a distribution inside a distribution": (_nested_distribution, _rescale),
}


@pytest.mark.parametrize("case", list(STATE_CASES))
def test_state_reached_through_keys_and_libraries_objects_is_guarded(case: str) -> None:
    """Found by probe round 17: each was kept at its first call's value."""
    global COUNT
    step, change = STATE_CASES[case]
    saved = OPTIMIZER.param_groups[0]["lr"], NESTED.base_dist.scale
    loc = NESTED.base_dist.loc.clone()
    traces = 1 if case == "a distribution inside a distribution" else 2  # inputs, not guards
    try:
        like_eager_then_retraced(ptj.jit(step), step, change, traces=traces, x=torch.ones(2))
    finally:
        PARTS.clear()
        PARTS.update(_parts())
        OPTIMIZER.param_groups[0]["lr"] = saved[0]
        NESTED.base_dist.scale = saved[1]
        NESTED.base_dist.loc.copy_(loc)
        MASKED.fill_value = 0.0
        COUNT = 1.0


HISTORY: collections.deque[torch.Tensor] = collections.deque(maxlen=3)


def _multistep(x: torch.Tensor) -> torch.Tensor:
    """An integrator whose order follows how much history it has (Adams-Bashforth)."""
    weights = {1: [1.0], 2: [1.5, -0.5], 3: [23 / 12, -16 / 12, 5 / 12]}[len(HISTORY)]
    return x + sum(w * h for w, h in zip(weights, reversed(HISTORY)))  # type: ignore[return-value]


def test_a_deque_of_tensors_growing_retraces() -> None:
    """A ``deque(maxlen=3)`` of tensors, the usual history of a multistep integrator, had no
    length guard: its order froze at the second trace (probe round 19)."""
    HISTORY.clear()
    expected = []
    jitted = ptj.jit(_multistep)
    try:
        for i in range(6):
            HISTORY.append(torch.full((2,), float(i + 1)))
            expected = _multistep(torch.ones(2))
            torch.testing.assert_close(jitted(torch.ones(2)), expected)
        assert jitted.num_traces == 3  # lengths 1, 2, 3; then it rotates: inputs
    finally:
        HISTORY.clear()


# Round 21: namedtuples whose fields hold objects or whose class has methods, and a property,
# staticmethod or cached_property wrapping a partial. Their items and the partial's bound values
# were never walked: every engine baked them.

_Config = collections.namedtuple("_Config", "solver dt")
NT_CONFIG = _Config(types.SimpleNamespace(k=1.0), 0.1)


class _WithMethod(collections.namedtuple("_WithMethod", "a b")):
    __slots__ = ()

    def total(self) -> float:
        return float(sum(self.a))


NT_WITH_METHOD = _WithMethod([1.0], 2.0)


class _Typed(NamedTuple):
    table: dict[str, float]
    dt: float

    def scale(self, x: torch.Tensor, key: str) -> torch.Tensor:
        return x * self.table[key] + self.dt


NT_TYPED = _Typed({"a": 1.0}, 0.1)
NT_TYPED_OP = functools.partial(NT_TYPED.scale, key="a")
_Stage = collections.namedtuple("_Stage", "params weight")
NT_STAGES = [_Stage(types.SimpleNamespace(c=1.0), 0.5), _Stage(types.SimpleNamespace(c=2.0), 0.5)]
BOUND_KS = [1.0]


def _times_first(self: Any, ks: list[float]) -> float:
    return ks[0] * self.base


class _Accessors:
    base = 2.0
    by_property = property(functools.partial(_times_first, ks=BOUND_KS))
    by_staticmethod = staticmethod(functools.partial(lambda ks: ks[0], BOUND_KS))


ACCESSORS = _Accessors()


def _staged(x: torch.Tensor) -> torch.Tensor:
    for i, stage in enumerate(NT_STAGES):
        x = x * stage.params.c * stage.weight + i
    return x


NAMEDTUPLES = {
    "an object in a namedtuple, read by a path": (
        lambda x: x * NT_CONFIG.solver.k + NT_CONFIG.dt,
        lambda: setattr(NT_CONFIG.solver, "k", 4.0),
    ),
    "a list in a namedtuple subclass with methods": (
        lambda x: x * NT_WITH_METHOD.a[0],
        lambda: NT_WITH_METHOD.a.__setitem__(0, 4.0),
    ),
    "a typing.NamedTuple's dict through a partial of its method": (
        lambda x: NT_TYPED_OP(x),
        lambda: NT_TYPED.table.__setitem__("a", 4.0),
    ),
    "a list of namedtuples holding objects, enumerated": (
        _staged,
        lambda: setattr(NT_STAGES[1].params, "c", 5.0),
    ),
    "a property over a partial": (
        lambda x: x * ACCESSORS.by_property,
        lambda: BOUND_KS.__setitem__(0, BOUND_KS[0] + 2.0),
    ),
    "a staticmethod over a partial": (
        lambda x: x * _Accessors.by_staticmethod(),
        lambda: BOUND_KS.__setitem__(0, BOUND_KS[0] + 2.0),
    ),
}


@pytest.mark.parametrize("case", list(NAMEDTUPLES))
def test_namedtuple_fields_and_partials_behind_accessors_are_guarded(case: str) -> None:
    """The items of a namedtuple (its fields are read through descriptors the guard does not
    run), and what a partial binds when a property or a staticmethod wraps it, found by probe
    round 21 silently baked on every engine."""
    step, change = NAMEDTUPLES[case]
    saved = (NT_CONFIG.solver.k, list(NT_WITH_METHOD.a), dict(NT_TYPED.table),
             NT_STAGES[1].params.c, list(BOUND_KS))  # fmt: skip
    try:
        like_eager_then_retraced(ptj.jit(step), step, change)
    finally:
        NT_CONFIG.solver.k, NT_WITH_METHOD.a[:] = saved[0], saved[1]
        NT_TYPED.table.update(saved[2])
        NT_STAGES[1].params.c, BOUND_KS[:] = saved[3], saved[4]


class _Knob:  # hashable by identity (a SimpleNamespace is not hashable)
    def __init__(self, v: float) -> None:
        self.v = v


KEYED_BY_TUPLES = {(1, _Knob(1.0)): 2.0}
KEYED_BY_NAMEDTUPLES = {_Config(_Knob(1.0), 0.1): 3.0}


def _by_tuple_keys(x: torch.Tensor) -> torch.Tensor:
    for key, weight in KEYED_BY_TUPLES.items():
        x = x * key[1].v * weight
    for key, weight in KEYED_BY_NAMEDTUPLES.items():
        x = x + key.solver.v * weight
    return x


def _change_the_keys_objects() -> None:
    for key in KEYED_BY_TUPLES:
        key[1].v += 1.0
    for key in KEYED_BY_NAMEDTUPLES:
        key.solver.v += 1.0


def test_objects_inside_tuple_keys_of_a_dict_are_guarded() -> None:
    """A tuple or namedtuple key holding an object (``for k, w in T.items(): k[1].v``) was
    taken for a value whose hash is its content, and its objects were never walked (probe
    round 22): they are walked by position now, like a key that is an object."""
    like_eager_then_retraced(ptj.jit(_by_tuple_keys), _by_tuple_keys, _change_the_keys_objects)


_MISSING = [1.0]


class _Defaulted(dict):  # type: ignore[type-arg]
    def __missing__(self, key: str) -> float:
        return _MISSING[0]


LOOK = _Defaulted(a=2.0).__getitem__  # a C method held bound: only Python calls __missing__


def _through_a_c_method(x: torch.Tensor) -> torch.Tensor:
    return x * LOOK("b") + LOOK("a")


def test_code_that_a_c_method_runs_for_its_object_is_walked() -> None:
    """``LOOK = TABLE.__getitem__`` held: the table's content was guarded, but not the code its
    class runs behind the C method (``__missing__`` reading a global), which probe round 23
    found baked on every engine. The walk goes from the method to its object and its class."""
    try:
        like_eager_then_retraced(
            ptj.jit(_through_a_c_method), _through_a_c_method, lambda: _MISSING.__setitem__(0, 4.0)
        )
    finally:
        _MISSING[0] = 1.0


CONFIG_MODULE = types.ModuleType("probe_config")  # a module of yours made at run time
CONFIG_MODULE.W_1 = 1.0  # type: ignore[attr-defined]


def _summing_a_modules_weights(x: torch.Tensor) -> torch.Tensor:
    return x * sum(v for k, v in vars(CONFIG_MODULE).items() if k.startswith("W_"))


def test_an_attribute_added_to_a_users_module_read_by_a_loop_over_it_retraces() -> None:
    """A loop over ``vars(config)`` (or ``dir(config)``) reads every attribute, also one added
    later, which probe round 23 found unseen (deleting or renaming one was seen: a read path
    went missing). How many names the module holds is guarded now."""
    try:
        like_eager_then_retraced(
            ptj.jit(_summing_a_modules_weights),
            _summing_a_modules_weights,
            lambda: setattr(CONFIG_MODULE, "W_2", 3.0),
        )
    finally:
        if hasattr(CONFIG_MODULE, "W_2"):
            delattr(CONFIG_MODULE, "W_2")


BOUND_TENSOR = torch.ones(3)
MUL = BOUND_TENSOR.mul  # a tensor's C method held apart from the tensor
SCALED = types.MethodType(lambda self, x: x * self, torch.full((3,), 2.0))


def _through_bound_tensors(x: torch.Tensor) -> torch.Tensor:
    return MUL(x) + SCALED(x)


def test_a_tensor_a_method_holds_bound_is_an_input_of_the_program() -> None:
    """``MUL = W.mul`` and ``types.MethodType(fn, W)``: the tensor, reached as the method's
    ``__self__`` (which cannot be set), is put in as a traced input through the method bound
    anew while tracing; the step had run eagerly with a warning that read like a crash
    (``attribute '__self__' ... is not writable``). Updates in place are seen, no retrace."""

    def update() -> None:
        with torch.no_grad():
            BOUND_TENSOR.mul_(3.0)
            SCALED.__self__.add_(1.0)

    saved = (BOUND_TENSOR.clone(), SCALED.__self__.clone())
    try:
        like_eager_then_retraced(
            ptj.jit(_through_bound_tensors), _through_bound_tensors, update, traces=1
        )
        assert MUL.__self__ is BOUND_TENSOR  # the method held is put back
    finally:
        with torch.no_grad():
            BOUND_TENSOR.copy_(saved[0])
            SCALED.__self__.copy_(saved[1])


class _Tagged(np.ndarray):  # an array subclass carrying an attribute of its own
    scale: float


def _tagged(values: list[float], scale: float) -> _Tagged:
    array = np.asarray(values).view(_Tagged)
    array.scale = scale
    return array


ARRAY = np.array([0.0, 1.0])
SCALAR = np.float64(0.0)
FLAGGED = np.array([1.0, 2.0])
LAID_OUT = np.ones((2, 2))
TAGGED = _tagged([1.0, 2.0], 1.0)
RECORDS = np.array([(1.0, 2.0)], dtype=[("k", "f8"), ("n", "f8")])

NUMPY_STATE: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[], None]]] = {
    "-0.0 written into an array": (
        lambda x: x * float(np.copysign(1.0, ARRAY[0])),
        lambda: ARRAY.__setitem__(0, -0.0),
    ),
    "a NumPy scalar rebound to -0.0": (
        lambda x: x * float(np.copysign(1.0, SCALAR)),
        lambda: globals().__setitem__("SCALAR", np.float64(-0.0)),
    ),
    "an array made read-only": (
        lambda x: x * (2.0 if FLAGGED.flags.writeable else 3.0),
        lambda: setattr(FLAGGED.flags, "writeable", False),
    ),
    "an equal array in Fortran order": (
        lambda x: x * (2.0 if LAID_OUT.flags.c_contiguous else 3.0),
        lambda: globals().__setitem__("LAID_OUT", np.asfortranarray(np.ones((2, 2)))),
    ),
    "an attribute of an array subclass": (
        lambda x: x * TAGGED.scale * float(TAGGED[0]),
        lambda: setattr(TAGGED, "scale", 4.0),
    ),
    "a structured array's fields renamed": (
        lambda x: x * float(RECORDS["k"][0]),
        lambda: setattr(RECORDS.dtype, "names", ("n", "k")),
    ),
}


@pytest.mark.parametrize("case", list(NUMPY_STATE))
def test_numpy_state_is_guarded_by_its_bits_layout_and_attributes(case: str) -> None:
    """Arrays were compared with ``np.array_equal`` (``-0.0`` equals ``0.0``) on a copy (in C
    order, sharing the dtype a rename changes in place, without the subclass's attributes),
    and a NumPy float scalar by ``==``: probe round 25 found each change baked on every
    engine. Now an array's bytes, class, dtype with its field names, strides, flags and
    plain attributes are compared, and a zero NumPy float by its repr."""
    global ARRAY, SCALAR, FLAGGED, LAID_OUT, TAGGED, RECORDS
    step, change = NUMPY_STATE[case]
    try:
        like_eager_then_retraced(ptj.jit(step), step, change)
    finally:
        ARRAY, SCALAR, FLAGGED = np.array([0.0, 1.0]), np.float64(0.0), np.array([1.0, 2.0])
        LAID_OUT, TAGGED = np.ones((2, 2)), _tagged([1.0, 2.0], 1.0)
        RECORDS = np.array([(1.0, 2.0)], dtype=[("k", "f8"), ("n", "f8")])


class _Strategy:
    def __init__(self) -> None:
        self.k = 2.0
        self.step = self.scaled  # a bound method of itself, kept on itself: a cycle

    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


STRATEGY = _Strategy()


def _through_a_cycle(x: torch.Tensor) -> torch.Tensor:
    return STRATEGY.step(x)


def test_a_cycle_back_to_an_object_is_not_walked_again(caplog: pytest.LogCaptureFixture) -> None:
    """``obj.step = obj.scaled``: the walk went obj -> step -> __self__ -> step ... (a method's
    object costs no depth), logged a path 70 steps long as "not guarded" and spent its budget
    of 512 paths on it (probe round 25). An object met again above itself is walked once."""
    try:
        with caplog.at_level("INFO", logger="phi_torch_jit"):
            like_eager_then_retraced(
                ptj.jit(_through_a_cycle), _through_a_cycle, lambda: setattr(STRATEGY, "k", 3.0)
            )
        assert "not guarded" not in caplog.text
    finally:
        STRATEGY.k = 2.0


SCALES_BY_TYPE: dict[type, float] = {float: 2.0, int: 3.0}


def _by_type(x: torch.Tensor) -> torch.Tensor:
    return x * SCALES_BY_TYPE[float]


class _TypeTable(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.gains = {torch.nn.Linear: 1.0, torch.nn.ReLU: 0.5}  # held, never read by forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_a_dict_keyed_by_classes_compiles_and_sees_its_changes() -> None:
    """The order of a dict's keys is guarded as ``tuple(d.keys())``: keyed by classes, that
    tuple was compared by identity, a new tuple at every read, so the step ran eagerly "as it
    changes Python state it reads" though nothing changed (probe round 26; an ``nn.Module``
    merely holding ``{nn.Linear: 1.0}`` ran whole eagerly). Such a tuple is compared by value
    now: the step compiles, and a changed entry or a key added retraces."""

    def change() -> None:
        SCALES_BY_TYPE[float] = 5.0
        SCALES_BY_TYPE[complex] = 1.0

    try:
        like_eager_then_retraced(ptj.jit(_by_type), _by_type, change)
    finally:
        SCALES_BY_TYPE.clear()
        SCALES_BY_TYPE.update({float: 2.0, int: 3.0})
    model = _TypeTable()
    jitted = ptj.jit(model)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for _ in range(4):
            torch.testing.assert_close(jitted(torch.ones(2, 3)), model(torch.ones(2, 3)))
    assert jitted.num_traces == 1


_Key = collections.namedtuple("_Key", "name")


class _Weight:
    def __init__(self, v: float) -> None:
        self.v = v


BY_RECORD = {_Key("a"): _Weight(2.0)}


def _by_record(x: torch.Tensor) -> torch.Tensor:
    for key, weight in BY_RECORD.items():
        x = x * weight.v * len(key.name)
    return x


def test_a_dict_keyed_by_namedtuples_compiles_and_sees_its_changes() -> None:
    """Keyed by namedtuples of plain values, ``tuple(d.keys())`` was compared by identity
    too: the step ran eagerly, warned that it changes what it reads (probe 51)."""

    def change() -> None:
        BY_RECORD[_Key("bcd")] = BY_RECORD.pop(_Key("a"))

    try:
        like_eager_then_retraced(ptj.jit(_by_record), _by_record, change)
    finally:
        BY_RECORD.clear()
        BY_RECORD[_Key("a")] = _Weight(2.0)


def _under_warning_filters(x: torch.Tensor) -> torch.Tensor:
    return x * (2.0 if warnings.filters else 1.0)


def test_a_librarys_own_registry_read_by_the_step_does_not_retrace_every_call() -> None:
    """``warnings.filters`` read in the step, each call inside ``catch_warnings()`` (which
    rebinds it to a copy): a library's registry is not guarded as state of yours (it held
    no code of yours and no plain values), so the loop does not retrace at every call."""
    jitted = ptj.jit(_under_warning_filters)
    for _ in range(5):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            jitted(torch.ones(3))
    assert jitted.num_traces == 1, jitted.explain()


class _Knob(float):
    factor = 2.0  # a class attribute of a float of yours


class _Mode(str):
    pass


KNOB = _Knob(1.5)
KNOB.offset = 1.0  # type: ignore[attr-defined]
MODE = _Mode("mul")
MODE.k = 2.0  # type: ignore[attr-defined]


class _Named:
    pass


NAMED = _Named()

NUMBERS_OF_YOURS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[], None]]] = {
    "an attribute of a float of yours": (
        lambda x: x * KNOB + KNOB.offset,  # type: ignore[attr-defined]
        lambda: setattr(KNOB, "offset", 4.0),
    ),
    "a class attribute of a float of yours": (
        lambda x: x * KNOB.factor,
        lambda: setattr(_Knob, "factor", 3.0),
    ),
    "an attribute of a str of yours": (
        lambda x: x * MODE.k if MODE == "mul" else x,  # type: ignore[attr-defined]
        lambda: setattr(MODE, "k", 5.0),
    ),
    "a class renamed": (
        lambda x: x * 2.0 if type(NAMED).__name__ == "_Named" else x - 3.0,
        lambda: setattr(_Named, "__name__", "Other"),
    ),
}


@pytest.mark.parametrize("case", list(NUMBERS_OF_YOURS))
def test_numbers_of_your_classes_and_class_names_are_guarded(case: str) -> None:
    """A float, int or str of a subclass of yours was guarded by value and exact type only:
    its attributes (``K.offset``, ``Knob.factor``) were baked; and a class's ``__name__`` lives
    on the type, not in its dict (probe round 26). Such a value is walked as an object now, and
    a class of yours has its names guarded."""
    step, change = NUMBERS_OF_YOURS[case]
    try:
        like_eager_then_retraced(ptj.jit(step), step, change)
    finally:
        KNOB.offset, _Knob.factor, MODE.k = 1.0, 2.0, 2.0  # type: ignore[attr-defined]
        _Named.__name__ = "_Named"


# A base class's data that a subclass defines again, read past the override (probe round 27)
class _BaseScale:
    K = 2.0
    SETTINGS = types.SimpleNamespace(k=2.0)


class _SubScale(_BaseScale):
    K = 7.0
    SETTINGS = types.SimpleNamespace(k=7.0)

    def base_k(self) -> float:
        return super().K


class _ScaledByBase(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * type(self).__mro__[1].K  # type: ignore[attr-defined]


class _ModuleScale(_ScaledByBase):
    K = 7.0


_ScaledByBase.K = 2.0  # type: ignore[attr-defined]
SUB = _SubScale()
SCALED_BY_BASE = _ModuleScale()


def _base_k_of(obj: Any) -> float:
    return float(type(obj).__mro__[1].K)


PAST_AN_OVERRIDE: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[], None]]] = {
    "super().K in a method": (lambda x: x * SUB.base_k(), lambda: setattr(_BaseScale, "K", 3.0)),
    "type(o).__mro__[1].K in a helper": (
        lambda x: x * _base_k_of(SUB),
        lambda: setattr(_BaseScale, "K", 3.0),
    ),
    "__bases__[0].K": (
        lambda x: x * type(SUB).__bases__[0].K,
        lambda: setattr(_BaseScale, "K", 3.0),
    ),
    "an object on the base class changed in place": (
        lambda x: x * type(SUB).__mro__[1].SETTINGS.k,
        lambda: setattr(_BaseScale.SETTINGS, "k", 3.0),
    ),
    "a module's forward": (SCALED_BY_BASE, lambda: setattr(_ScaledByBase, "K", 3.0)),
}


@pytest.mark.parametrize("case", list(PAST_AN_OVERRIDE))
def test_a_base_class_value_read_past_a_subclass_override_is_guarded(case: str) -> None:
    """``super().K``, ``type(o).__mro__[1].K``, ``__bases__[0].K``: a class of yours was
    walked for the data its MRO shows, which is the subclass's ``K``; the base's was baked on
    every engine (probe round 27). A base class of yours whose data a class before it in the
    MRO defines again is walked as a class of its own."""
    step, change = PAST_AN_OVERRIDE[case]
    try:
        like_eager_then_retraced(ptj.jit(step), step, change)
    finally:
        _BaseScale.K, _BaseScale.SETTINGS.k, _ScaledByBase.K = 2.0, 2.0, 2.0  # type: ignore[attr-defined]


class _Going:
    def __init__(self) -> None:
        self.k = 2.0

    def go(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


def test_a_bound_method_stored_anew_each_call_does_not_retrace() -> None:
    """``box["m"] = s.go`` in the loop makes a new bound method each time, equal to the last
    (same object, same function): it retraced every call, then ran eagerly (probe round 27).
    A bound method is compared by equality; its object's state and its function are walked."""
    going = _Going()
    box: dict[str, Any] = {"m": going.go}

    def step(x: torch.Tensor) -> torch.Tensor:
        return box["m"](x)  # type: ignore[no-any-return]

    jitted = ptj.jit(step)
    x = torch.linspace(0.5, 1.5, 3)
    for _ in range(6):
        torch.testing.assert_close(jitted(x), step(x))
        box["m"] = going.go
    assert jitted.num_traces == 1, jitted.explain()
    going.k = 3.0
    torch.testing.assert_close(jitted(x), step(x))
    other = _Going()
    other.k = 5.0
    box["m"] = other.go
    torch.testing.assert_close(jitted(x), step(x))
    assert jitted.num_traces == 3, jitted.explain()


CTYPES_ARRAY = (ctypes.c_double * 3)(1.0, 2.0, 3.0)


def _through_a_ctypes_array(x: torch.Tensor) -> torch.Tensor:
    for factor in CTYPES_ARRAY:
        x = x * factor
    return x


def test_a_ctypes_array_read_whole_is_guarded_by_what_it_holds() -> None:
    """Probe 41c: ``CA[1]`` was guarded, but a loop over a ``ctypes`` array (or ``sum(CA)``)
    kept the first call's numbers on every engine."""

    def change() -> None:
        CTYPES_ARRAY[0] = 5.0

    try:
        like_eager_then_retraced(ptj.jit(_through_a_ctypes_array), _through_a_ctypes_array, change)
    finally:
        CTYPES_ARRAY[0] = 1.0


class _CtypesSettings(ctypes.Structure):
    _fields_ = [("k", ctypes.c_double)]


CTYPES_STRUCT = _CtypesSettings(3.0)


def test_a_ctypes_structures_field_is_guarded() -> None:
    """Probe 41a: ``ST.k`` of a ``ctypes.Structure`` held in a global kept its first value."""
    step = lambda x: x * CTYPES_STRUCT.k  # noqa: E731

    def change() -> None:
        CTYPES_STRUCT.k = 7.0

    try:
        like_eager_then_retraced(ptj.jit(step), step, change)
    finally:
        CTYPES_STRUCT.k = 3.0


def _registering(
    dispatched: bool,
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[], None]]:
    """A step testing an object against a new ABC (``isinstance``, or through a single-dispatch
    function), and the change that registers the object's class with the ABC (for good: a new
    ABC for each test)."""

    class Scalable(abc.ABC):  # noqa: B024 (no abstract methods: only registered classes)
        pass

    class Plain:
        k = 2.0

    held = Plain()

    @functools.singledispatch
    def coefficient(value: Any) -> float:
        return 1.0

    @coefficient.register(Scalable)
    def _(value: Any) -> float:
        return 3.0

    def tested(x: torch.Tensor) -> torch.Tensor:
        return x * held.k if isinstance(held, Scalable) else x + 1

    def through_dispatch(x: torch.Tensor) -> torch.Tensor:
        return x * coefficient(held)

    return (through_dispatch if dispatched else tested), lambda: Scalable.register(Plain)


@pytest.mark.parametrize("dispatched", [False, True], ids=["isinstance", "singledispatch"])
def test_what_an_abcs_register_changes_retraces(dispatched: bool) -> None:
    """Probe 41a: ``ABC.register(C)`` changes what ``isinstance`` answers and where a
    single-dispatch function dispatches, in C state no attribute shows; the compiled program
    kept the first answer on every engine. ``abc.get_cache_token()``, which every register
    changes, is guarded where code of yours names ``isinstance``/``issubclass`` or calls a
    single-dispatch function."""
    step, change = _registering(dispatched)
    like_eager_then_retraced(ptj.jit(step), step, change)
