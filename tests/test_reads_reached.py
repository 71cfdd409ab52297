"""State a step reaches through the callables and objects it is handed or holds, not only
through names its own code spells: a bound method or partial passed as an argument, a
partial of a bound method, partials kept in dicts and lists, a method replaced on its class,
the user's modules used only as containers, paths five levels deep, a hundred objects a loop
iterates, tables of a hundred numbers. Each change retraces (or runs eagerly with one
JitWarning), never a stale value. Every engine (shared suite)."""

from __future__ import annotations

import array
import builtins
import collections
import configparser
import contextvars
import dataclasses
import enum
import functools
import gc
import glob
import importlib
import inspect
import json
import math
import os
import queue
import random
import struct
import sys
import tempfile
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from helpers import like_eager_after_each
from torch import nn

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines


def _like_eager(jitted: Callable[..., Any], eager: Callable[..., Any], args: tuple[Any, ...],
                changes: list[Callable[[], None]]) -> None:  # fmt: skip
    """Two calls per state, no JitWarning: the compiled program serves the later calls."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for change in [lambda: None, *changes]:
            change()
            for _ in range(2):
                torch.testing.assert_close(jitted(*args), eager(*args))
                jitted.wait_compiled()


class Integrator:
    SUBSTEPS = 1

    def __init__(self, dt: float) -> None:
        self.dt = dt

    def advance(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.SUBSTEPS):
            x = x * (1 - self.dt)
        return x


def _apply(x: torch.Tensor, advance: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    return advance(x) + 1


def test_the_object_of_a_bound_method_passed_as_an_argument_is_guarded() -> None:
    integrator = Integrator(0.1)
    jitted = ptj.jit(_apply)
    x = torch.linspace(1, 2, 3)
    changes = [lambda: setattr(integrator, "dt", 0.5),
               lambda: setattr(integrator, "SUBSTEPS", 3)]  # fmt: skip
    _like_eager(jitted, lambda x, _: _apply(x, integrator.advance), (x, integrator.advance),
                changes)  # fmt: skip
    assert jitted.num_traces == 3


class Solver:
    def __init__(self) -> None:
        self.tol, self.scale = 0.5, 2.0


def _precondition(r: torch.Tensor, cfg: SimpleNamespace) -> torch.Tensor:
    return torch.clamp(r, -cfg.solver.tol, cfg.solver.tol) * cfg.solver.scale


def test_a_partial_passed_as_an_argument_has_its_configuration_guarded() -> None:
    cfg = SimpleNamespace(solver=Solver())
    precondition = functools.partial(_precondition, cfg=cfg)
    jitted = ptj.jit(_apply)
    r = torch.linspace(-2, 2, 5)

    def rebind() -> None:
        cfg.solver = Solver()
        cfg.solver.scale = -1.0

    changes = [lambda: setattr(cfg.solver, "tol", 0.1), rebind]
    _like_eager(jitted, _apply, (r, precondition), changes)
    assert jitted.num_traces == 3


class Damper:
    def __init__(self) -> None:
        self.gamma = 0.1

    def apply(self, v: torch.Tensor, dt: float) -> torch.Tensor:
        return v * (1 - self.gamma * dt)


DAMPER = Damper()
DAMP = functools.partial(DAMPER.apply, dt=1.0)  # a partial of a bound method
PHYSICS = SimpleNamespace(nu=0.1)


def _diffuse(u: torch.Tensor, cfg: SimpleNamespace) -> torch.Tensor:
    return u * cfg.nu


OPERATORS = {"diffuse": functools.partial(_diffuse, cfg=PHYSICS)}
TERMS = [functools.partial(_diffuse, cfg=PHYSICS)]


def _held(v: torch.Tensor) -> torch.Tensor:
    v = DAMP(v) + OPERATORS["diffuse"](v)
    for term in TERMS:
        v = v + term(v)
    return v


def test_partials_of_bound_methods_and_partials_in_dicts_and_lists_are_walked() -> None:
    jitted = ptj.jit(_held)
    v = torch.linspace(1, 2, 3)
    try:
        changes = [lambda: setattr(DAMPER, "gamma", 0.9), lambda: setattr(PHYSICS, "nu", 0.4)]
        _like_eager(jitted, _held, (v,), changes)
    finally:
        DAMPER.gamma, PHYSICS.nu = 0.1, 0.1
    assert jitted.num_traces == 3


class Limiter:
    @staticmethod
    def clip(x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(x, -1, 1)


class Limited(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.limiter = Limiter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.limiter.clip(x) * 2


INTEGRATOR = Integrator(0.5)


def _integrated(x: torch.Tensor) -> torch.Tensor:
    return INTEGRATOR.advance(x)


def test_a_method_replaced_on_its_class_retraces() -> None:
    jitted = ptj.jit(_integrated)
    x = torch.linspace(1, 2, 3)
    original = Integrator.advance
    try:
        changes = [lambda: setattr(Integrator, "advance", lambda self, x: x * 0.0)]
        _like_eager(jitted, _integrated, (x,), changes)
    finally:
        Integrator.advance = original  # type: ignore[method-assign]
    assert jitted.num_traces == 2
    model = Limited()
    jitted_model = ptj.jit(model)
    clip = vars(Limiter)["clip"]  # the staticmethod object
    try:
        changes = [lambda: setattr(Limiter, "clip", staticmethod(lambda x: x * 0.0))]
        _like_eager(jitted_model, model, (torch.linspace(-2, 2, 5),), changes)
    finally:
        setattr(Limiter, "clip", clip)  # noqa: B010
    assert jitted_model.num_traces == 2


class Settings(nn.Module):
    """A module used as a configuration container: never called."""

    def __init__(self) -> None:
        super().__init__()
        self.limits = [-1.0, 1.0]
        self.solver = SimpleNamespace(tol=0.5)


SETTINGS = Settings()


def _clamped(u: torch.Tensor) -> torch.Tensor:
    return _helper(u, SETTINGS)


def _helper(u: torch.Tensor, settings: Settings) -> torch.Tensor:
    return torch.clamp(u, settings.limits[0], settings.limits[1]) * settings.solver.tol


def test_a_module_used_only_as_a_container_has_its_attributes_guarded() -> None:
    jitted = ptj.jit(_clamped)
    u = torch.linspace(-2, 2, 5)
    try:
        changes = [lambda: SETTINGS.limits.__setitem__(1, 0.05),
                   lambda: setattr(SETTINGS.solver, "tol", 2.0)]  # fmt: skip
        _like_eager(jitted, _clamped, (u,), changes)
    finally:
        SETTINGS.limits[1], SETTINGS.solver.tol = 1.0, 0.5
    assert jitted.num_traces == 3


def _noise() -> Iterator[float]:
    value = 0.0
    while True:
        value += 1.0
        yield value


def test_an_iterator_held_by_a_container_module_runs_eagerly_with_one_warning() -> None:
    holder = nn.Module()
    holder.noise = _noise()  # type: ignore[assignment]
    reference = _noise()
    jitted = ptj.jit(lambda x: x + next(holder.noise))  # type: ignore[call-overload]
    x = torch.zeros(2)
    with pytest.warns(ptj.JitWarning, match="iterator") as caught:
        for _ in range(4):
            assert torch.equal(jitted(x), x + next(reference))
    assert len([w for w in caught if issubclass(w.category, ptj.JitWarning)]) == 1


class Forcing:
    def __init__(self) -> None:
        self.params = SimpleNamespace(k=1.0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.params.k * FORCING_GAIN["gain"]


FORCING_GAIN = {"gain": 1.0}


def test_a_callable_arguments_nested_state_and_the_globals_its_methods_read_are_guarded() -> None:
    forcing = Forcing()
    jitted = ptj.jit(_apply)
    x = torch.linspace(1, 2, 3)
    try:
        changes = [lambda: setattr(forcing.params, "k", 2.5),
                   lambda: FORCING_GAIN.__setitem__("gain", 0.5)]  # fmt: skip
        _like_eager(jitted, _apply, (x, forcing), changes)
    finally:
        FORCING_GAIN["gain"] = 1.0
    assert jitted.num_traces == 3


class LookupConfig:
    """Attributes looked up in a dict: a missing name raises KeyError, not AttributeError."""

    def __init__(self, **values: float) -> None:
        object.__setattr__(self, "_data", dict(values))

    def __getattr__(self, name: str) -> float:
        return self._data[name]  # type: ignore[no-any-return]

    def __setattr__(self, name: str, value: float) -> None:
        self._data[name] = value


LOOKUP_CONFIG = LookupConfig(dt=0.1)


def _scaled(u: torch.Tensor) -> torch.Tensor:
    return u * LOOKUP_CONFIG.dt


def test_a_config_whose_getattr_raises_key_error_is_guarded_not_a_crash() -> None:
    jitted = ptj.jit(_scaled)
    try:
        _like_eager(jitted, _scaled, (torch.ones(2),), [lambda: setattr(LOOKUP_CONFIG, "dt", 2.0)])
    finally:
        LOOKUP_CONFIG.dt = 0.1
    assert jitted.num_traces == 2


_TABLE = {"k": 2.0}


class _FromTable:
    """Every attribute from a table: ``__class__`` too, which it does not have."""

    def __getattribute__(self, name: str) -> Any:
        return _TABLE[name]


_ANSWERING = _FromTable()


def _from_the_table(x: torch.Tensor) -> torch.Tensor:
    return x * _ANSWERING.k


_HOOKED = nn.Linear(2, 2)
_HOOKED.register_forward_hook(lambda module, args, out: out * _ANSWERING.k)


def _hooked(x: torch.Tensor) -> torch.Tensor:
    return _HOOKED(x)


@pytest.mark.all_engines
@pytest.mark.parametrize("step", [_from_the_table, _hooked], ids=["read", "read by a hook"])
def test_an_object_whose_every_lookup_may_raise_runs_the_step_eagerly_not_a_crash(
    step: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """``isinstance`` asks an object for its ``__class__`` when its type does not answer; a
    ``__getattribute__`` answering from a table raised KeyError there, and the jitted call
    raised where eager code ran (probe 46). The walk's failure now runs the step eagerly,
    warned once, with eager's values after a change. Read only by a hook of a global module,
    the object's walk raised out of the snapshot before the record pass (until session 41)."""
    jitted, x = ptj.jit(step), torch.ones(2)
    try:
        with pytest.warns(ptj.JitWarning, match="the walk of the state it reads raised KeyError"):
            torch.testing.assert_close(jitted(x), step(x))
        _TABLE["k"] = 3.0
        torch.testing.assert_close(jitted(x), step(x))
    finally:
        _TABLE["k"] = 2.0
    assert "runs eagerly" in jitted.explain()


def _failing_walk(*args: Any, **kwargs: Any) -> Any:
    raise ptj.errors.WalkFailed("the walk of the state it reads raised KeyError: 'k'")


_LINEAR = nn.Linear(2, 2)


def _counted_linear(x: torch.Tensor, calls: list[int]) -> torch.Tensor:
    calls.append(1)
    return _LINEAR(x) * _TABLE["k"]


@pytest.mark.all_engines
@pytest.mark.parametrize(
    "walk", ["hook_reads", "CachedCalls.guarded", "collect_reads"], ids=lambda w: w.split(".")[-1]
)
def test_a_walk_failing_after_the_record_pass_keeps_its_result_and_runs_eagerly(
    monkeypatch: pytest.MonkeyPatch, walk: str
) -> None:
    """Each walk after the record pass (the step's, its modules' hooks', what its cached
    functions returned) may fail as the one before it does (probe 46); the record pass's
    result is the call's, the function runs once per call, eagerly from then, warned once
    (before session 41 only the step's walk was caught: the others crashed the call)."""
    import phi_torch_jit._pipeline as pipeline

    holder, _, name = walk.rpartition(".")
    monkeypatch.setattr(getattr(pipeline, holder) if holder else pipeline, name, _failing_walk)
    jitted, x, calls = ptj.jit(_counted_linear), torch.ones(2), []
    try:
        with pytest.warns(ptj.JitWarning, match="runs eagerly: the walk of the state it reads"):
            torch.testing.assert_close(jitted(x, calls), _LINEAR(x) * 2.0)
        assert len(calls) == 1  # the record pass only
        _TABLE["k"] = 3.0
        torch.testing.assert_close(jitted(x, calls), _LINEAR(x) * 3.0)
        assert len(calls) == 2 and "runs eagerly" in jitted.explain()
    finally:
        _TABLE["k"] = 2.0


SIMULATION = SimpleNamespace(
    physics=SimpleNamespace(terms=[SimpleNamespace(params=SimpleNamespace(c=2.0))])
)
STAGES = [SimpleNamespace(v=float(i)) for i in range(100)]


def _deep_and_wide(x: torch.Tensor) -> torch.Tensor:
    for term in SIMULATION.physics.terms:  # five levels to the value
        x = x * term.params.c
    return x + STAGES[90].v  # the 91st of 100 objects


def test_paths_five_levels_deep_and_a_hundred_objects_are_guarded() -> None:
    jitted = ptj.jit(_deep_and_wide)
    x = torch.ones(3)
    term = SIMULATION.physics.terms[0]
    try:
        changes = [lambda: setattr(term.params, "c", -20.0),
                   lambda: setattr(STAGES[90], "v", 7.0)]  # fmt: skip
        _like_eager(jitted, _deep_and_wide, (x,), changes)
    finally:
        term.params.c, STAGES[90].v = 2.0, 90.0
    assert jitted.num_traces == 3


PAIRS = [[[0.0, 1.0] for _ in range(64)] for _ in range(64)]  # 4096 rows of numbers
PAIRS_DT = 0.1


def _advance(x: torch.Tensor) -> torch.Tensor:
    return x * PAIRS_DT


def _helper_then_table(x: torch.Tensor) -> torch.Tensor:
    return _advance(x) + PAIRS[0][0][1]


def test_a_helper_read_beside_a_large_table_of_numbers_is_walked() -> None:
    """Probe round 35: walked depth first, the 4096 rows of number pairs (read after the
    helper) used up the objects the walk looks at, and the helper's ``PAIRS_DT`` was not
    guarded: silently the first value, on every engine."""
    jitted = _like_eager_with_global(_helper_then_table, "PAIRS_DT", 0.5)
    assert jitted.num_traces == 2 and "past the walk's limits" not in jitted.explain()


def _like_eager_with_global(step: Callable[..., Any], name: str, changed: float) -> Any:
    """The jitted ``step``, equal to eager before and after the global ``name`` changes
    (restored after)."""
    jitted, was = ptj.jit(step), globals()[name]
    try:
        _like_eager(jitted, step, (torch.ones(3),), [lambda: globals().__setitem__(name, changed)])
    finally:
        globals()[name] = was
    return jitted


SCALE_OF_FIRST = 2.0


def _adding(j: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: x + j


REGISTRY = [lambda x: x * SCALE_OF_FIRST] + [_adding(j) for j in range(398)]
REGISTRY.append(lambda x: x * SCALE_OF_LAST)
SCALE_OF_LAST = 3.0


def _first_of_registry(x: torch.Tensor) -> torch.Tensor:
    return REGISTRY[0](x)


def _last_of_registry(x: torch.Tensor) -> torch.Tensor:
    return REGISTRY[-1](x)


def test_a_registrys_first_entries_are_walked_and_what_lies_past_the_limits_is_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A registry of 401 lambdas: the walk stops at 400 functions. Walked depth first, it
    left out the first entries (``REGISTRY[0]`` read ``SCALE_OF_FIRST`` unguarded); now the
    nearest come first, and what lies past the limits is named (logged, ``explain()``)
    instead of silently unguarded."""
    jitted = _like_eager_with_global(_first_of_registry, "SCALE_OF_FIRST", 5.0)
    assert jitted.num_traces == 2
    last = ptj.jit(_last_of_registry)
    with caplog.at_level("WARNING", logger="phi_torch_jit"):
        last(torch.ones(3))
    said = "calls past the walk's limits (it walks at most 400 functions and 4000 objects)"
    assert said in last.explain() and said in caplog.text


class Table(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cfg = collections.OrderedDict(scale=1.0)


TABLE_MODULE = Table()
HISTORY = collections.deque([0.1, 0.2], maxlen=3)
COEFFICIENTS = array.array("d", [1.0, 2.0])


def _containers(x: torch.Tensor) -> torch.Tensor:
    for c in COEFFICIENTS:  # read by iteration, not by index
        x = x * c
    return x * TABLE_MODULE.cfg["scale"] + sum(HISTORY)


def test_ordered_dicts_deques_and_arrays_are_guarded_by_content() -> None:
    jitted = ptj.jit(_containers)
    x = torch.ones(2)
    try:
        changes = [lambda: TABLE_MODULE.cfg.__setitem__("scale", -2.0),
                   lambda: HISTORY.append(1.0), lambda: HISTORY.append(5.0),  # past maxlen
                   lambda: COEFFICIENTS.__setitem__(1, -3.0)]  # fmt: skip
        _like_eager(jitted, _containers, (x,), changes)
    finally:
        TABLE_MODULE.cfg["scale"] = 1.0
        HISTORY.clear()
        HISTORY.extend([0.1, 0.2])
        COEFFICIENTS[1] = 2.0
    assert jitted.num_traces == 5


class Model:
    def rhs(self, x: torch.Tensor) -> torch.Tensor:
        return -x


MODEL = Model()
PARAMETERS = SimpleNamespace()


def _attributes_added_later(x: torch.Tensor) -> torch.Tensor:
    return MODEL.rhs(x) + getattr(PARAMETERS, "shift", 0.0)


def test_an_attribute_added_later_shadowing_a_method_or_read_with_a_default_retraces() -> None:
    jitted = ptj.jit(_attributes_added_later)
    x = torch.ones(2)
    try:
        changes = [lambda: setattr(MODEL, "rhs", lambda x: x * 0 + 42.0),
                   lambda: setattr(PARAMETERS, "shift", 5.0)]  # fmt: skip
        _like_eager(jitted, _attributes_added_later, (x,), changes)
    finally:
        vars(MODEL).pop("rhs", None)
        vars(PARAMETERS).pop("shift", None)
    assert jitted.num_traces == 3


class Base:
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


class Child(Base):
    def _scale(self, x: torch.Tensor, k: float) -> torch.Tensor:
        return x * k

    scaled = functools.partialmethod(_scale, k=2.0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return super().__call__(x) + self.scaled(x)


CHILD = Child()


def _called(x: torch.Tensor) -> torch.Tensor:
    return CHILD(x)


def test_a_partialmethod_or_a_base_classes_method_replaced_retraces() -> None:
    jitted = ptj.jit(_called)
    x = torch.ones(2)
    scaled, call = vars(Child)["scaled"], vars(Base)["__call__"]
    try:
        changes = [lambda: setattr(Child, "scaled", functools.partialmethod(Child._scale, k=-5.0)),
                   lambda: setattr(Base, "__call__", lambda self, x: x * 0.0)]  # fmt: skip
        _like_eager(jitted, _called, (x,), changes)
    finally:
        Child.scaled, Base.__call__ = scaled, call  # type: ignore[method-assign]
    assert jitted.num_traces == 3


def _imports_its_settings(x: torch.Tensor) -> torch.Tensor:
    import read_settings as settings  # imported while the step runs: read through a local

    return x * settings.GRAVITY


def _imports_by_name(x: torch.Tensor) -> torch.Tensor:
    import importlib

    settings = importlib.import_module("read_settings")
    return x * settings.GRAVITY


_SETTINGS = "read"


def _imports_by_a_computed_name(x: torch.Tensor) -> torch.Tensor:
    import importlib

    settings = importlib.import_module(_SETTINGS + "_settings")  # no constant names it
    return x * settings.GRAVITY


def _imports_by_dunder_import(x: torch.Tensor) -> torch.Tensor:
    name = "_".join((_SETTINGS, "settings"))
    return x * __import__(name).GRAVITY


def _looks_it_up_in_sys_modules(x: torch.Tensor) -> torch.Tensor:
    import sys

    return x * sys.modules["read_settings"].GRAVITY


@pytest.mark.parametrize(
    "step",
    [_imports_its_settings, _imports_by_name, _imports_by_a_computed_name,
     _imports_by_dunder_import, _looks_it_up_in_sys_modules],
    ids=["import", "importlib", "computed name", "__import__", "sys.modules"],
)  # fmt: skip
def test_a_users_module_imported_inside_the_step_is_guarded(step: Callable[..., Any]) -> None:
    """``import read_settings`` in the step, or ``importlib.import_module("read_settings")``
    (no import statement, no global names it): the module reaches a local, and its data kept
    the first value. A name computed at run time is seen by the record pass
    (``_modules_seen``); ``sys.modules["read_settings"]`` by its constant."""
    import read_settings

    jitted = ptj.jit(step)
    before = read_settings.GRAVITY
    try:
        changes = [lambda: setattr(read_settings, "GRAVITY", before * 3)]
        _like_eager(jitted, step, (torch.ones(2),), changes)
    finally:
        read_settings.GRAVITY = before
    assert jitted.num_traces == 2


class Irreps(tuple):  # type: ignore[type-arg]
    """A library's tuple subclass with rules of its own (e3nn's Irreps: no ``len``)."""

    def __len__(self) -> int:
        raise NotImplementedError


IRREPS = Irreps((2.0, 3.0))


def _irreps(x: torch.Tensor) -> torch.Tensor:
    return x * IRREPS[0]


def test_a_container_subclass_whose_len_raises_is_guarded_by_identity_not_a_crash() -> None:
    jitted = ptj.jit(_irreps)
    _like_eager(jitted, _irreps, (torch.ones(2),), [])
    assert jitted.num_traces == 1


class Scheme(enum.Enum):
    EULER = (1.0, [1.0])  # a member whose value holds a list of stage weights


GAIN = contextvars.ContextVar("gain", default=1.0)
LOCAL = threading.local()


class Physics:
    def __init__(self) -> None:
        self.k = 2.0


PHYSICS_OBJECT = Physics()
PROXY = weakref.proxy(PHYSICS_OBJECT)


def _scoped(x: torch.Tensor) -> torch.Tensor:
    weights = Scheme.EULER.value[1]
    return x * sum(weights) * GAIN.get() * getattr(LOCAL, "scale", 1.0) * PROXY.k


def test_enum_values_context_variables_thread_locals_and_weak_proxies_are_guarded() -> None:
    jitted = ptj.jit(_scoped)
    x = torch.ones(2)
    token = GAIN.set(2.0)
    try:
        changes = [lambda: Scheme.EULER.value[1].__setitem__(0, 3.0),
                   lambda: Scheme.EULER.value[1].append(1.0),
                   lambda: GAIN.set(-3.0), lambda: setattr(LOCAL, "scale", 5.0),
                   lambda: setattr(PHYSICS_OBJECT, "k", 0.5)]  # fmt: skip
        _like_eager(jitted, _scoped, (x,), changes)
    finally:
        GAIN.reset(token)
        Scheme.EULER.value[1][:] = [1.0]
        vars(LOCAL).pop("scale", None)
        PHYSICS_OBJECT.k = 2.0
    assert jitted.num_traces == 6


class Material(enum.Enum):
    """Members with attributes of their own: set by ``__init__``, and one set later."""

    STEEL = (1, 2.0)

    def __init__(self, code: int, stiffness: float) -> None:
        self.stiffness = stiffness


Material.STEEL.damping = 0.5  # type: ignore[attr-defined]


def _material(x: torch.Tensor) -> torch.Tensor:
    return x * Material.STEEL.stiffness + Material.STEEL.damping  # type: ignore[attr-defined]


def test_the_attributes_an_enum_member_holds_are_guarded() -> None:
    """A member was compared as one object, by identity: an attribute changed on it kept the
    traced value. Its attributes are state like any object's."""
    jitted = ptj.jit(_material)
    changes = [lambda: setattr(Material.STEEL, "stiffness", 3.0),
               lambda: setattr(Material.STEEL, "damping", -1.0)]  # fmt: skip
    try:
        _like_eager(jitted, _material, (torch.ones(2),), changes)
    finally:
        Material.STEEL.stiffness = 2.0
        Material.STEEL.damping = 0.5  # type: ignore[attr-defined]
    assert jitted.num_traces == 3


def test_an_enum_member_argument_is_keyed_by_the_attributes_it_holds() -> None:
    def step(x: torch.Tensor, material: Material) -> torch.Tensor:
        return x * material.stiffness

    jitted = ptj.jit(step)
    x = torch.ones(2)
    try:
        _like_eager(
            jitted, step, (x, Material.STEEL), [lambda: setattr(Material.STEEL, "stiffness", 4.0)]
        )
    finally:
        Material.STEEL.stiffness = 2.0
    assert jitted.num_traces == 2


def test_a_context_variable_read_under_each_calls_own_context_is_that_contexts_value() -> None:
    jitted = ptj.jit(_scoped)
    x = torch.ones(2)
    for gain in (2.0, -3.0, 4.0, 2.0):
        context = contextvars.copy_context()
        context.run(GAIN.set, gain)
        torch.testing.assert_close(context.run(jitted, x), context.run(_scoped, x))
        jitted.wait_compiled()
    assert jitted.num_traces == 3


def _scale_from_environment() -> float:
    import os

    return float(os.getenv("PTJ_TEST_SCALE", "1.0"))


def test_the_environment_read_by_the_step_or_a_function_it_calls_is_guarded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``os.environ`` is no container the guards compared (a library object): a variable
    exported between calls (a run script switching a physics option) kept the first value.
    Read directly and through ``os.getenv`` in a called function, it retraces."""
    import os

    monkeypatch.setenv("PTJ_TEST_SCALE", "2.0")
    monkeypatch.setenv("PTJ_TEST_MODE", "damped")

    def step(x: torch.Tensor) -> torch.Tensor:
        damping = 0.5 if os.environ.get("PTJ_TEST_MODE") == "damped" else 1.0
        return x * damping * _scale_from_environment()

    jitted = ptj.jit(step)
    _like_eager(jitted, step, (torch.ones(3),), [
        lambda: monkeypatch.setenv("PTJ_TEST_SCALE", "3.0"),
        lambda: monkeypatch.setenv("PTJ_TEST_MODE", "free"),
        lambda: monkeypatch.delenv("PTJ_TEST_SCALE"),
    ])  # fmt: skip
    assert jitted.num_traces >= 2


class Stepper:
    """State kept private, changed through a setter: the step reads it in a method."""

    def __init__(self, dt: float) -> None:
        self._dt = dt
        self.__substeps = 1

    def set_dt(self, dt: float) -> None:
        self._dt = dt

    def refine(self) -> None:
        self.__substeps += 1

    def advance(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.__substeps):
            x = x * (1 - self._dt)
        return x


STEPPER = Stepper(0.1)


def _stepper() -> Stepper:
    return STEPPER


def test_private_attributes_of_an_object_the_step_reaches_are_guarded() -> None:
    """``self._dt`` changed by a setter, a name-mangled ``self.__substeps``, and a private
    name built at run time (``getattr(obj, "_" + name)``) on an object a function returns:
    the walk listed public attributes only, and each kept its first value."""

    def step(x: torch.Tensor) -> torch.Tensor:
        scale = getattr(_stepper(), "_" + "dt")
        return STEPPER.advance(x) + scale

    jitted = ptj.jit(step)
    try:
        _like_eager(jitted, step, (torch.ones(3),), [
            lambda: STEPPER.set_dt(0.5),
            STEPPER.refine,
        ])  # fmt: skip
    finally:
        STEPPER.__init__(0.1)  # type: ignore[misc]
    assert jitted.num_traces == 3


def _damping(x: torch.Tensor, rate: float = 0.5) -> torch.Tensor:
    return x * rate


def _doubled(x: torch.Tensor, rate: float = 0.5) -> torch.Tensor:
    return 2 * x * rate


def test_a_called_functions_code_or_defaults_replaced_retraces() -> None:
    """``f.__code__ = g.__code__`` (hot-patching a physics term) and ``f.__defaults__ = (...)``
    keep the function object, which the guard held by identity: both kept the first code."""

    def step(x: torch.Tensor) -> torch.Tensor:
        return _damping(x) + 1

    code, defaults = _damping.__code__, _damping.__defaults__
    jitted = ptj.jit(step)
    try:
        _like_eager(jitted, step, (torch.ones(3),), [
            lambda: setattr(_damping, "__code__", _doubled.__code__),
            lambda: setattr(_damping, "__defaults__", (0.25,)),
        ])  # fmt: skip
    finally:
        _damping.__code__, _damping.__defaults__ = code, defaults
    assert jitted.num_traces == 3


@dataclasses.dataclass(slots=True)
class _SlotSettings:
    dt: float
    _gain: float = 1.0


SLOT_SETTINGS = _SlotSettings(0.1)


def _slot_scaled(x: torch.Tensor, settings: _SlotSettings) -> torch.Tensor:
    return x * settings.dt * settings._gain


def test_an_object_with_slots_reached_through_a_call_is_guarded() -> None:
    """A dataclass with ``slots=True`` has no ``__dict__``: the walk guarded it by identity
    only, and a changed field read through a parameter of a called function was stale."""

    def step(x: torch.Tensor) -> torch.Tensor:
        return _slot_scaled(x, SLOT_SETTINGS)

    jitted = ptj.jit(step)
    try:
        _like_eager(jitted, step, (torch.ones(3),), [
            lambda: setattr(SLOT_SETTINGS, "dt", 0.5),
            lambda: setattr(SLOT_SETTINGS, "_gain", 2.0),
        ])  # fmt: skip
    finally:
        SLOT_SETTINGS.dt, SLOT_SETTINGS._gain = 0.1, 1.0
    assert jitted.num_traces == 3


LOOKED_UP = {"k": 1.0}


def test_a_global_looked_up_through_globals_is_guarded() -> None:
    """``globals()["LOOKED_UP"]`` loads no global by name: each string constant of code that
    calls ``globals`` is taken as a global it may read."""

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * globals()["LOOKED_UP"]["k"]

    jitted = ptj.jit(step)
    try:
        _like_eager(jitted, step, (torch.ones(3),), [lambda: LOOKED_UP.update(k=4.0)])
    finally:
        LOOKED_UP["k"] = 1.0
    assert jitted.num_traces == 2


def _gravity_of(x: torch.Tensor, settings: Any) -> torch.Tensor:
    return x * settings.GRAVITY


def test_a_users_module_held_in_a_local_or_passed_on_and_its_classes_are_guarded() -> None:
    """A module of the user's reached other than by a chain the code spells from its global
    (``m = settings; m.GRAVITY``, ``helper(x, settings)``), and a class in it
    (``settings.Limits.RATE``, also ``k = settings.Limits; k.RATE``): the module and the class
    were guarded by identity only, their data stale."""
    import read_settings

    def step(x: torch.Tensor) -> torch.Tensor:
        alias = read_settings
        limits = read_settings.Limits
        return _gravity_of(x, read_settings) + alias.TABLE["drag"][1] + limits.RATE

    def through_chain(x: torch.Tensor) -> torch.Tensor:
        return x * read_settings.Limits.RATE

    gravity, rate = read_settings.GRAVITY, read_settings.Limits.RATE
    try:
        for fn in (step, through_chain):  # each change retraces: the module is walked whole
            jitted = ptj.jit(fn)
            _like_eager(jitted, fn, (torch.ones(3),), [
                lambda: setattr(read_settings, "GRAVITY", 1.0),
                lambda: read_settings.TABLE["drag"].__setitem__(1, 5.0),
                lambda: setattr(read_settings.Limits, "RATE", read_settings.Limits.RATE + 1),
            ])  # fmt: skip
            assert jitted.num_traces == 4
            read_settings.GRAVITY, read_settings.Limits.RATE = gravity, rate
            read_settings.TABLE["drag"][1] = 0.2
    finally:
        read_settings.GRAVITY, read_settings.Limits.RATE = gravity, rate
        read_settings.TABLE["drag"][1] = 0.2


class _Tempered:
    """A callable object (no nn.Module) jitted itself: ``jit(tempered)``."""

    def __init__(self) -> None:
        self.shift = 0.0
        self._temperature = 1.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x / self._temperature + self.shift


def test_a_callable_object_jitted_itself_has_its_attributes_guarded() -> None:
    """``jit(obj)`` for an object with ``__call__``: its attributes are read through ``self``
    (a parameter), and the object was no root of the walk: every change was stale."""
    tempered = _Tempered()
    jitted = ptj.jit(tempered)
    _like_eager(jitted, tempered, (torch.ones(3),), [
        lambda: setattr(tempered, "_temperature", 2.0),
        lambda: setattr(tempered, "shift", 1.0),
    ])  # fmt: skip
    assert jitted.num_traces == 3


SCALE = 2.0


def _evaluates(x: torch.Tensor) -> torch.Tensor:
    return x * eval("SCALE * 1.5")


def _executes(x: torch.Tensor) -> torch.Tensor:
    found: dict[str, Any] = {}
    exec("k = SCALE + 1", globals(), found)
    return x * found["k"]


@pytest.mark.parametrize("step", [_evaluates, _executes], ids=["eval", "exec"])
def test_a_global_read_by_source_text_the_step_evaluates_is_guarded(
    step: Callable[..., Any],
) -> None:
    """``eval("SCALE * 1.5")``: no instruction of the step loads ``SCALE``; the names of the
    source text it evaluates (a constant string) are read like its own."""
    _retraces_when_a_global_changes(step, "SCALE", 5.0)


def _retraces_when_a_global_changes(step: Callable[..., Any], name: str, value: Any) -> None:
    """Like eager before and after this module's global ``name`` becomes ``value``: one
    retrace."""
    jitted, before = ptj.jit(step), globals()[name]
    try:
        _like_eager(jitted, step, (torch.ones(2),), [lambda: globals().update({name: value})])
    finally:
        globals()[name] = before
    assert jitted.num_traces == 2


def _with_settings(x: torch.Tensor, settings: Any) -> torch.Tensor:
    return x * settings.GRAVITY + settings.TABLE["drag"][1]


def test_a_configuration_module_passed_as_an_argument_is_guarded() -> None:
    """``step(x, settings)``: a module is an argument keyed by identity (it was refused as
    an object without a value hash); a module of yours has its data guarded like a global's,
    a library's (``math``) is taken as it is."""
    import math

    import read_settings

    jitted = ptj.jit(_with_settings)
    gravity, drag = read_settings.GRAVITY, list(read_settings.TABLE["drag"])
    try:
        changes = [lambda: setattr(read_settings, "GRAVITY", gravity * 2),
                   lambda: read_settings.TABLE["drag"].__setitem__(1, 5.0)]  # fmt: skip
        _like_eager(jitted, _with_settings, (torch.ones(2), read_settings), changes)
    finally:
        read_settings.GRAVITY, read_settings.TABLE["drag"] = gravity, drag
    assert jitted.num_traces == 3
    on_math = ptj.jit(lambda x, m: x * m.pi)
    torch.testing.assert_close(on_math(torch.ones(2), math), torch.ones(2) * math.pi)


class Node:
    def __init__(self, w: float, nxt: Node | None = None, children: list[Node] | None = None):
        self.w, self.next, self.children = w, nxt, children or []


CHAIN = Node(1.0)
for _ in range(11):
    CHAIN = Node(1.0, CHAIN)
TREE = Node(1.0)
for _ in range(8):
    TREE = Node(1.0, children=[Node(0.5), TREE])


def _follows_links(x: torch.Tensor) -> torch.Tensor:
    node: Node | None = CHAIN
    while node is not None:  # the loop variable walks twelve objects down
        x = x * node.w
        node = node.next
    stack = [TREE]
    while stack:
        node = stack.pop()
        x = x + node.w
        stack += node.children
    return x


def _deepest(root: Node, attribute: str) -> Node:
    while getattr(root, attribute):
        root = getattr(root, attribute) if attribute == "next" else root.children[-1]
    return root


def test_a_loop_following_links_of_one_class_reads_every_node() -> None:
    """``node = node.next`` in a loop: a linked list of twelve nodes, a tree nine levels deep.
    The walk over objects goes seven levels of data deep; links between objects of one class
    cost no level (up to 32), so a change at the far end retraces."""
    jitted = ptj.jit(_follows_links)
    last, leaf = _deepest(CHAIN, "next"), _deepest(TREE, "children")
    try:
        changes = [lambda: setattr(last, "w", 3.0), lambda: setattr(leaf, "w", -4.0)]
        _like_eager(jitted, _follows_links, (torch.ones(2),), changes)
    finally:
        last.w = leaf.w = 1.0
    assert jitted.num_traces == 3


class Level:
    def __init__(self, inner: Any) -> None:
        self.inner = inner


class Leaf:
    def __init__(self) -> None:
        self.value = 1.0


_LEVELS = [type(f"Level{i}", (Level,), {}) for i in range(8)]  # eight classes, not one
DEEP: Any = Leaf()
for _level in _LEVELS:
    DEEP = _level(DEEP)


def _reads_deep(x: torch.Tensor) -> torch.Tensor:
    level = DEEP
    while isinstance(level, Level):
        level = level.inner
    return x * level.value


def test_an_object_of_yours_below_the_walks_depth_is_guarded_as_the_step_reads_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Objects of different classes eight levels down: past the walk's depth, what the step
    reads of them is guarded (watched in the second record pass), and nothing is logged."""
    jitted = ptj.jit(_reads_deep)
    leaf = DEEP
    while isinstance(leaf, Level):
        leaf = leaf.inner
    try:
        with caplog.at_level("WARNING", logger="phi_torch_jit"):
            _like_eager(
                jitted, _reads_deep, (torch.ones(2),), [lambda: setattr(leaf, "value", 3.0)]
            )
    finally:
        leaf.value = 1.0
    assert jitted.num_traces == 2
    assert "not guarded" not in jitted.explain()
    assert not any("levels down" in r.getMessage() for r in caplog.records)


DEEP_LIST: Any = SimpleNamespace(values=[1.0] * 70_000)  # more than the guard takes past the
for _level in _LEVELS:  # walk's limits (_reads._overflow.MAX_COMPARED, MAX_LEAVES)
    DEEP_LIST = _level(DEEP_LIST)


def _reads_deep_list(x: torch.Tensor) -> torch.Tensor:
    level = DEEP_LIST
    while isinstance(level, Level):
        level = level.inner
    return x * level.values[7]


def test_an_object_below_the_walks_depth_is_named_as_not_guarded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A list of 70000 numbers eight levels down (its items are read by subscript, which no
    record pass watches, and more than the guard takes past the walk's limits): beyond the
    walk's depth, and said so (the log at the trace, explain()), never assumed constant
    silently."""
    jitted = ptj.jit(_reads_deep_list)
    with caplog.at_level("WARNING", logger="phi_torch_jit"):
        for _ in range(2):
            jitted(torch.ones(2))
    assert "7 levels down, the walk's depth" in jitted.explain()
    assert any("levels down" in r.getMessage() for r in caplog.records)


SOLVER = Physics()  # another object than the proxy's above
SOLVER_REF = weakref.ref(SOLVER)


def _through_a_weak_reference(x: torch.Tensor) -> torch.Tensor:
    solver = SOLVER_REF()
    return x * (solver.k if solver is not None else 0.0)


def test_an_object_held_by_a_weak_reference_is_guarded() -> None:
    """``ref()`` in the step: the object the reference holds is walked like one read
    directly (``weakref.ref``'s referent, as a ``ContextVar``'s value)."""
    jitted = ptj.jit(_through_a_weak_reference)
    try:
        _like_eager(jitted, _through_a_weak_reference, (torch.ones(2),),
                    [lambda: setattr(SOLVER, "k", 0.25)])  # fmt: skip
    finally:
        SOLVER.k = 2.0
    assert jitted.num_traces == 2


def _forced(x: torch.Tensor, forcing: Iterator[float]) -> torch.Tensor:
    return x + next(forcing)


def test_an_iterator_passed_as_an_argument_runs_the_step_eagerly_warned_once() -> None:
    """``step(x, forcing)`` with a generator: it was refused (no value hash); the step runs
    eagerly, with one JitWarning, each call taking one item as eager code does."""

    def forcing() -> Iterator[float]:
        yield from (1.0, 2.0, 3.0, 4.0, 5.0, 6.0)

    jitted = ptj.jit(_forced)
    mine, theirs = forcing(), forcing()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ptj.JitWarning)
        for _ in range(5):
            torch.testing.assert_close(jitted(torch.ones(2), mine), _forced(torch.ones(2), theirs))
    warned = [str(w.message) for w in caught if issubclass(w.category, ptj.JitWarning)]
    assert len(warned) == 1 and "iterator" in warned[0], warned
    assert next(mine) == next(theirs) == 6.0


def _forced_by_the_first(x: torch.Tensor, held: Any) -> torch.Tensor:
    for forcing in held:  # a frozenset argument, or a WeakSet global
        return x + next(forcing)
    return x


class _Knob:
    def __init__(self) -> None:
        self.k = 2.0


def _knobbed(x: torch.Tensor, knobs: frozenset[_Knob]) -> torch.Tensor:
    for knob in knobs:
        x = x * knob.k
    return x


_REGISTERED: Any = weakref.WeakSet()


def _forced_by_a_registered(x: torch.Tensor) -> torch.Tensor:
    return _forced_by_the_first(x, _REGISTERED)


def test_an_iterator_in_a_frozenset_argument_or_a_weak_set_runs_the_step_eagerly() -> None:
    """Probe 39b: a generator inside a frozenset argument (keyed by the set's ``repr()``) or
    inside a ``WeakSet`` the step loops over (its members were not walked) was compiled: the
    traced item repeated on every call. Objects in a frozenset argument are keyed as in a
    tuple (an iterator: eager, warned; an object of yours without a value hash: refused, as
    in a tuple, where it had been keyed by identity and its attributes went stale)."""

    def forcing() -> Iterator[float]:
        yield from (1.0, 2.0, 3.0, 4.0, 5.0, 6.0)

    global _REGISTERED
    kept = [forcing(), forcing()]  # (the WeakSet holds them weakly)
    _REGISTERED = weakref.WeakSet([kept[0]])
    theirs, jitted = forcing(), ptj.jit(_forced_by_a_registered)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ptj.JitWarning)
        for _ in range(4):
            expected = _forced_by_the_first(torch.ones(2), [theirs])
            torch.testing.assert_close(jitted(torch.ones(2)), expected)
        mine, theirs = frozenset([kept[1]]), forcing()
        jitted = ptj.jit(_forced_by_the_first)
        for _ in range(4):
            expected = _forced_by_the_first(torch.ones(2), [theirs])
            torch.testing.assert_close(jitted(torch.ones(2), mine), expected)
    warned = [str(w.message) for w in caught if issubclass(w.category, ptj.JitWarning)]
    assert len(warned) == 2 and all("iterator" in w for w in warned), warned
    assert "list(global _REGISTERED)[0]" in warned[0]
    with pytest.raises(ptj.SignatureError, match=r"`knobs\[0\]`.*no value-based hash"):
        ptj.jit(_knobbed)(torch.ones(2), frozenset([_Knob()]))


class _Options:
    def __init__(self, k: float) -> None:
        self.k = k


DUNDER_OPTIONS = _Options(2.0)


def _decorated(x: torch.Tensor) -> torch.Tensor:
    return x


class _Configured:
    __config__ = DUNDER_OPTIONS


def _options_of(obj: Any) -> float:
    """A helper reading what it is given: ``fn.__opts__`` or ``type(obj).__config__``."""
    return float(obj.__opts__.k if callable(obj) else obj.__config__.k)


def _through_dunder_names(x: torch.Tensor) -> torch.Tensor:
    return x * _options_of(_decorated) + _options_of(_CONFIGURED) * 10


_CONFIGURED = _Configured()


def test_objects_under_dunder_names_of_yours_are_walked() -> None:
    """Probe 39a: the walk skipped every ``__x__`` attribute of a function, an instance or a
    class, so ``fn.__opts__`` (a decorator's options) and a class's ``__config__`` changed in
    place or replaced kept the traced value on every engine. Only the names Python and its
    library put there are skipped now."""
    _decorated.__opts__ = DUNDER_OPTIONS  # type: ignore[attr-defined]

    def set_k(k: float) -> Callable[[], None]:
        return lambda: setattr(DUNDER_OPTIONS, "k", k)

    def replace(holder: Any, name: str) -> Callable[[], None]:
        return lambda: setattr(holder, name, _Options(7.0))

    jitted, x = ptj.jit(_through_dunder_names), torch.ones(2)
    changes = [set_k(3.0), replace(_decorated, "__opts__"), replace(_Configured, "__config__")]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        like_eager_after_each(jitted, lambda f: f(x), _through_dunder_names, changes)
    assert jitted.num_traces <= 4  # (engines keeping a number as an input retrace less)


_LIBRARY = '''
class Integrator:
    """A library's object holding the user's right-hand side (as ODE solvers and schedulers
    hold callbacks)."""

    def __init__(self, rhs):
        self.rhs = rhs
        self.steps = 0

    def step(self, x, dt):
        return x + dt * self.rhs(x)
'''

DECAY = 1.0


def _decay(x: torch.Tensor) -> torch.Tensor:
    return -DECAY * x


def _grow(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x


def test_code_of_yours_held_by_a_librarys_object_is_walked(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``integrator = lib.Integrator(my_rhs)``: the library's object is guarded by identity,
    its internals not walked; the code of yours it holds is: the globals ``my_rhs`` reads,
    and which function the attribute holds (``integrator.rhs = other``) retrace."""
    import importlib

    folder = tmp_path / "site-packages"  # a library, wherever it lies (_sources)
    folder.mkdir()
    (folder / "ptj_fake_integrators.py").write_text(_LIBRARY)
    monkeypatch.syspath_prepend(str(folder))
    library = importlib.import_module("ptj_fake_integrators")
    monkeypatch.delitem(sys.modules, "ptj_fake_integrators")
    integrator = library.Integrator(_decay)

    def step(x: torch.Tensor) -> torch.Tensor:
        return integrator.step(x, 0.1)  # type: ignore[no-any-return]

    global DECAY
    jitted = ptj.jit(step)
    try:
        changes = [lambda: globals().update(DECAY=4.0), lambda: setattr(integrator, "rhs", _grow)]
        _like_eager(jitted, step, (torch.ones(2),), changes)
    finally:
        DECAY = 1.0
    assert jitted.num_traces == 3


def test_tensors_held_by_a_librarys_object_are_read_at_every_call() -> None:
    """``torch.distributions.Normal(loc, scale)`` keeps its tensors as attributes of a
    library's object, which is guarded by identity: they were constants of the program, and a
    change in place, or another tensor put there, kept the traced values."""
    normal = torch.distributions.Normal(torch.tensor(0.0), torch.tensor(1.0))

    def step(x: torch.Tensor) -> torch.Tensor:
        return normal.log_prob(x)

    jitted = ptj.jit(step)
    changes = [lambda: normal.loc.fill_(2.0), lambda: setattr(normal, "loc", torch.tensor(-3.0)),
               lambda: normal.scale.mul_(4.0)]  # fmt: skip
    _like_eager(jitted, step, (torch.arange(4.0),), changes)


WARMUP = 0.5


def test_a_schedulers_lambdas_held_in_a_list_are_walked() -> None:
    """torch's ``LambdaLR`` keeps the user's ``lr_lambda`` in a list attribute: the global it
    reads is guarded."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda e: WARMUP**e)

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * schedule.lr_lambdas[0](2)

    _retraces_when_a_global_changes(step, "WARMUP", 0.25)


_NAME = "SCA"


def _own_module_attribute(x: torch.Tensor) -> torch.Tensor:
    return x * sys.modules[__name__].SCALE


def _own_module_getattr(x: torch.Tensor) -> torch.Tensor:
    return x * getattr(sys.modules[__name__], _NAME + "LE")


def _own_module_vars(x: torch.Tensor) -> torch.Tensor:
    return x * vars(sys.modules[__name__])["SCALE"]


def _evaluates_built_source(x: torch.Tensor) -> torch.Tensor:
    return x * eval(_NAME + "LE * 1.5")


def _executes_built_source(x: torch.Tensor) -> torch.Tensor:
    found: dict[str, Any] = {}
    exec(f"k = {_NAME}LE + 1", globals(), found)
    return x * found["k"]


@pytest.mark.parametrize(
    "step",
    [_own_module_attribute, _own_module_getattr, _own_module_vars, _evaluates_built_source,
     _executes_built_source],
    ids=["sys.modules[__name__]", "getattr of a built name", "vars", "eval", "exec"],
)  # fmt: skip
def test_a_global_read_by_a_name_built_at_run_time_is_guarded(step: Callable[..., Any]) -> None:
    """The step's own module reached through ``sys.modules[__name__]``, an attribute name
    or source text built at run time: no instruction or constant names ``SCALE``. The record
    pass sees the read (``_modules_seen``)."""
    _retraces_when_a_global_changes(step, "SCALE", 5.0)


_PREFIX = "read"


def _module_by_a_computed_key(x: torch.Tensor) -> torch.Tensor:
    settings = sys.modules[_PREFIX + "_settings"]  # no import, no constant names it
    return settings.scaled(x) + settings.TABLE["drag"][1]


def test_a_users_module_looked_up_by_a_computed_key_and_the_code_it_runs_are_guarded() -> None:
    """``sys.modules[PREFIX + "_settings"]``: the attributes read are guarded, and a
    function of the module called there is walked like one a global names (its global
    ``GRAVITY``); the function replaced retraces too."""
    import read_settings

    gravity, scaled = read_settings.GRAVITY, read_settings.scaled
    jitted = ptj.jit(_module_by_a_computed_key)
    try:
        _like_eager(jitted, _module_by_a_computed_key, (torch.ones(2),), [
            lambda: setattr(read_settings, "GRAVITY", gravity * 2),
            lambda: read_settings.TABLE["drag"].__setitem__(1, 5.0),
            lambda: setattr(read_settings, "scaled", lambda x: x - 1),
        ])  # fmt: skip
    finally:
        read_settings.GRAVITY, read_settings.scaled = gravity, scaled
        read_settings.TABLE["drag"][1] = 0.2
    assert jitted.num_traces <= 4  # (engines keeping a number as an input retrace less)


_ENTRY = "ptj_test_entry_settings"


def _entry_looked_up(x: torch.Tensor) -> torch.Tensor:
    return x * sys.modules[_ENTRY].K


def _entry_imported(x: torch.Tensor) -> torch.Tensor:
    return x * importlib.import_module(_ENTRY).K


@pytest.mark.parametrize("step", [_entry_looked_up, _entry_imported],
                         ids=["sys.modules[NAME]", "import_module(NAME)"])  # fmt: skip
def test_a_module_replaced_under_its_name_in_sys_modules_retraces(
    step: Callable[[torch.Tensor], torch.Tensor],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The module a step reaches by a name computed at run time may be put under another name
    than its own (``sys.modules[NAME] = other``): every name ``sys.modules`` holds it under is
    guarded. Before, a file module's entry was not (the walk of ``sys.modules`` ran out of room
    in torch's C submodules, taken for modules of the user's made at run time: hundreds of
    guards and log lines), and a module made at run time (``types.ModuleType``) put there was
    not watched: both kept their first value. Neither the library's C submodules nor the
    registry are guarded now."""
    (tmp_path / "ptj_test_entry_file.py").write_text("K = 2.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from_file = importlib.import_module("ptj_test_entry_file")
    monkeypatch.setitem(sys.modules, "ptj_test_entry_file", from_file)  # removed afterwards
    made = types.ModuleType(_ENTRY)
    made.K = 7.0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, _ENTRY, from_file)
    jitted = ptj.jit(step)
    _like_eager(jitted, step, (torch.ones(2),), [
        lambda: setattr(from_file, "K", 3.0),
        lambda: sys.modules.__setitem__(_ENTRY, made),
        lambda: setattr(made, "K", -1.0),
        lambda: sys.modules.__setitem__(_ENTRY, from_file),  # the second trace's again
    ])  # fmt: skip
    assert jitted.num_traces >= 3  # the file's module, the one made at run time, its change
    assert "_onnx" not in jitted.explain() and "typing.io" not in jitted.explain()


def test_a_librarys_submodules_without_a_file_are_not_the_users() -> None:
    """A module without a file or spec is the user's (``types.ModuleType("config")``, the
    ``__main__`` of ``python -c``) unless its package is a library's: torch's C submodules
    and the standard library's aliases are not walked as configuration."""
    from phi_torch_jit._sources import user_module

    assert not user_module(sys.modules["torch._C._onnx"])
    assert user_module(types.ModuleType("config"))
    assert user_module(types.ModuleType("my_package.config"))
    assert not user_module(types.ModuleType("torch.config_of_mine"))


class _Scaled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x) * 2

    def act(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def test_a_modules_methods_replaced_on_its_class_or_shadowed_on_it_retrace() -> None:
    """``Net.forward = other`` or ``Net.act = other`` on the module's class, and
    ``net.forward = f`` set on the module itself: the module guard knew parameters, hooks and
    flags, not which code the module runs (a plain class's methods were guarded already)."""
    net = _Scaled()
    jitted = ptj.jit(lambda x: net(x))
    forward, act = _Scaled.forward, _Scaled.act
    try:
        _like_eager(jitted, lambda x: net(x), (torch.ones(3),), [
            lambda: setattr(_Scaled, "act", lambda self, x: x - 1),
            lambda: setattr(_Scaled, "forward", lambda self, x: self.act(x) * 5),
            lambda: setattr(net, "forward", lambda x: x * 7),
        ])  # fmt: skip
    finally:
        _Scaled.forward, _Scaled.act = forward, act  # type: ignore[method-assign]
    assert jitted.num_traces <= 4  # (engines keeping a number as an input retrace less)


def _strided(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    scale = float(y.stride()[0]) if y.is_contiguous() else 10.0 * y.stride()[0]
    return x * scale + y


def test_the_layout_of_an_argument_is_part_of_the_key() -> None:
    """Python that reads an argument's strides (``stride()``, ``is_contiguous()``) saw the first
    call's layout: a view with gaps (``m[:, 0]``) was served the contiguous tensor's program,
    and its trace ran on a contiguous copy."""
    jitted = ptj.jit(_strided)
    x, dense, gappy = torch.ones(3), torch.ones(3), torch.ones(3, 2)[:, 0]
    for y in (dense, gappy, dense):
        for _ in range(3):
            torch.testing.assert_close(jitted(x, y), _strided(x, y))
            jitted.wait_compiled()
    assert jitted.num_traces == 2


LAYOUT = torch.arange(4.0).reshape(2, 2)
LAYOUTS = [torch.arange(4.0).reshape(2, 2)]


def _reads_strides(x: torch.Tensor) -> torch.Tensor:
    for s in LAYOUT.stride():
        x = x * s + 1
    return x + 1 if LAYOUTS[0].is_contiguous() else x


def test_the_layout_of_a_tensor_the_step_reads_from_state_is_guarded() -> None:
    """As an argument's (probe 36c): a global rebound to a transposed view, a tensor in a
    list transposed in place (``t_()``) kept the first layout's program."""
    global LAYOUT
    jitted, x = ptj.jit(_reads_strides), torch.ones(1)

    def rebind() -> None:
        global LAYOUT
        LAYOUT = torch.arange(4.0).reshape(2, 2).t()

    like_eager_after_each(jitted, lambda f: f(x), _reads_strides, [rebind, LAYOUTS[0].t_])
    assert jitted.num_traces == 3
    LAYOUT = torch.arange(4.0).reshape(2, 2)
    LAYOUTS[0] = torch.arange(4.0).reshape(2, 2)


def test_a_tensor_held_twice_and_written_in_place_runs_eagerly_like_eager() -> None:
    """``PARTS = [w, w]`` (a tied weight) written through both places: a captured graph took
    them as two inputs, the second never saw the first one's ``add_`` (probe 36c)."""

    def writing_twice(parts: list[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        def step(x: torch.Tensor) -> torch.Tensor:
            for t in parts:
                t.add_(1)
                x = x * t.sum()
            return x

        return step

    w, twin = torch.ones(2), torch.ones(2)
    jitted, eager, x = ptj.jit(writing_twice([w, w])), writing_twice([twin, twin]), torch.ones(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ptj.JitWarning)
        for _ in range(3):
            torch.testing.assert_close(jitted(x), eager(x))
        jitted.wait_compiled()
        for _ in range(3):
            torch.testing.assert_close(jitted(x), eager(x))
    torch.testing.assert_close(w, twin)


def test_negative_zero_as_an_argument_is_not_served_zeros_program() -> None:
    def signed(x: torch.Tensor, f: float) -> torch.Tensor:
        return x * math.copysign(1.0, f)

    jitted = ptj.jit(signed)
    for f in (0.0, -0.0, 0.0):
        for _ in range(2):
            torch.testing.assert_close(jitted(torch.ones(2), f), signed(torch.ones(2), f))
    assert jitted.num_traces == 2


class _Table(dict):  # type: ignore[type-arg]
    """A dict subclass of the user's: ``get``, ``in`` and ``values`` read it, no subscript."""


class _Tags(set):  # type: ignore[type-arg]
    pass


TABLE_OF_YOURS = _Table(k=2.0)
TAGS = _Tags({"damped"})
PLAIN = {"a": 1.0, "b": 2.0}
PLAIN_VALUES = PLAIN.values()
WRAPPED = collections.UserDict(k=3.0)


def _reads_containers_through_methods(x: torch.Tensor) -> torch.Tensor:
    damping = 0.5 if "damped" in TAGS else 1.0
    return x * TABLE_OF_YOURS.get("k") * damping + sum(PLAIN_VALUES) + WRAPPED.get("k")


def test_containers_read_through_methods_and_views_are_guarded() -> None:
    """A dict, list or set subclass of yours, a ``UserDict`` and a dict's view held in a global
    (``v = d.values()``): read by ``get``, ``in`` or ``sum`` (no subscript the code spells),
    their contents were guarded by identity only."""
    changes = [lambda: TABLE_OF_YOURS.update(k=5.0), lambda: TAGS.discard("damped"),
               lambda: PLAIN.update(b=7.0), lambda: WRAPPED.update(k=9.0)]  # fmt: skip
    jitted = ptj.jit(_reads_containers_through_methods)
    try:
        _like_eager(jitted, _reads_containers_through_methods, (torch.ones(2),), changes)
    finally:
        TABLE_OF_YOURS["k"], PLAIN["b"], WRAPPED["k"] = 2.0, 2.0, 3.0
        TAGS.add("damped")
    assert jitted.num_traces == 5


class _Gain:
    def __init__(self) -> None:
        self.factor = 2.0

    def apply(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out * self.factor


HOOK_SHIFT = 0.5


def test_what_a_modules_hooks_read_is_guarded() -> None:
    """A forward hook that is a bound method (``gain.factor``), a pre-hook partial with a
    keyword dict, a hook closing over a config dict and a global hook reading a global: their
    state was never guarded (hooks by identity only). (What a hook changes on every call runs
    the step eagerly: ``test_hooks::test_hooks_that_change_their_own_state_run_eagerly_warned``.)
    """
    net = nn.Linear(3, 3)
    gain, config = _Gain(), {"k": 1.0}

    def pre(module: nn.Module, args: Any, scale: float) -> Any:
        return (args[0] * scale,)

    def post(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out + config["k"]

    def shifted(module: nn.Module, args: Any, out: Any) -> Any:
        return out + HOOK_SHIFT if module is net else None

    net.register_forward_hook(gain.apply)
    scaled = functools.partial(pre, scale=1.0)
    net.register_forward_pre_hook(scaled)
    net.register_forward_hook(post)
    handle = nn.modules.module.register_module_forward_hook(shifted)
    jitted = ptj.jit(lambda x: net(x))
    try:
        with torch.no_grad():
            _like_eager(jitted, lambda x: net(x), (torch.ones(2, 3),), [
                lambda: setattr(gain, "factor", 3.0),
                lambda: scaled.keywords.update(scale=2.0),
                lambda: config.update(k=4.0),
                lambda: globals().update(HOOK_SHIFT=2.0),
            ])  # fmt: skip
    finally:
        handle.remove()
        globals()["HOOK_SHIFT"] = 0.5
    assert jitted.num_traces == 5


def test_a_python_attribute_set_on_a_parameter_is_guarded() -> None:
    """``net.weight.scale = 2.0`` (a tag a library or the user puts on a parameter): the
    module guard compared parameters by identity and metadata, not their Python attributes."""
    net = nn.Linear(3, 3)
    net.weight.scale = 2.0  # type: ignore[attr-defined]

    def step(x: torch.Tensor) -> torch.Tensor:
        return net(x) * net.weight.scale  # type: ignore[no-any-return]

    jitted = ptj.jit(step)
    _like_eager(jitted, step, (torch.ones(3),), [lambda: setattr(net.weight, "scale", 5.0)])
    assert jitted.num_traces == 2


DECORATED_GAIN = 2.0


@torch.compiler.disable
def _with_grad(x: torch.Tensor) -> torch.Tensor:
    return x * DECORATED_GAIN


def test_functions_of_yours_under_a_librarys_decorator_are_walked() -> None:
    """``@torch.compiler.disable`` or ``@functools.singledispatch`` on a helper: the name holds
    the library's wrapper (its code is torch's or functools'), so the walk stopped there and
    the helper's globals were never guarded. A registration added later retraces too."""

    @functools.singledispatch
    def gain_for(value: object) -> float:
        return DECORATED_GAIN

    def step(x: torch.Tensor) -> torch.Tensor:
        return _with_grad(x) + x * gain_for(1.0)

    jitted = ptj.jit(step)
    try:
        _like_eager(jitted, step, (torch.ones(2),), [
            lambda: globals().update(DECORATED_GAIN=5.0),
            lambda: gain_for.register(float, lambda value: 3.0),
        ])  # fmt: skip
    finally:
        globals()["DECORATED_GAIN"] = 2.0
    assert jitted.num_traces == 3


class _Tuning:
    pass


class _Tuned(_Tuning):
    pass


TUNED = _Tuned()


def _tuned(x: torch.Tensor) -> torch.Tensor:
    return x * getattr(TUNED, "boost", 1.0) + (1.0 if hasattr(type(TUNED), "shift") else 0.0)


def test_an_attribute_added_later_to_a_class_or_its_base_retraces() -> None:
    """``getattr(obj, "boost", 1.0)`` and ``hasattr(type(obj), "shift")``, then ``Base.boost =
    5.0`` set on the class or a base: the instance's attributes were counted, its classes'
    were not."""
    jitted = ptj.jit(_tuned)
    try:
        _like_eager(jitted, _tuned, (torch.ones(2),), [
            lambda: setattr(_Tuning, "boost", 5.0),
            lambda: setattr(_Tuned, "shift", True),
        ])  # fmt: skip
    finally:
        for klass, name in ((_Tuning, "boost"), (_Tuned, "shift")):
            if name in vars(klass):
                delattr(klass, name)
    assert jitted.num_traces == 3


ORDER_SIGN = 1.0


class _Ranked:
    def __init__(self, v: float) -> None:
        self.v = v

    def __lt__(self, other: _Ranked) -> bool:
        return self.v * ORDER_SIGN < other.v * ORDER_SIGN


RANKED = [_Ranked(1.0), _Ranked(2.0)]


def _ranks(x: torch.Tensor) -> torch.Tensor:
    low, high = sorted(RANKED)
    return x * low.v + 10 * high.v


def test_methods_python_calls_on_objects_in_a_list_are_walked() -> None:
    """``sorted(ITEMS)`` runs ``Item.__lt__``, which reads a global: objects in a list were
    walked for their data, not for their class's code."""
    _retraces_when_a_global_changes(_ranks, "ORDER_SIGN", -1.0)


def _reads_a_builtin_setting(x: torch.Tensor) -> torch.Tensor:
    return x * PTJ_TEST_SETTING  # type: ignore[name-defined]  # noqa: F821 (set on builtins)


def _rounds(x: torch.Tensor) -> torch.Tensor:
    return x * round(2.4)


def test_a_builtin_shadowed_later_by_a_global_retraces() -> None:
    """``round = my_round`` set in the module after the trace: the step's ``round`` is now
    the global, but the program had baked in the builtin's 2."""
    jitted = ptj.jit(_rounds)
    try:
        _like_eager(jitted, _rounds, (torch.ones(2),),
                    [lambda: globals().__setitem__("round", lambda v: 10)])  # fmt: skip
    finally:
        globals().pop("round", None)
    assert jitted.num_traces == 2


def test_a_name_set_on_builtins_and_read_as_a_global_is_guarded() -> None:
    """``builtins.SETTING = 2.0`` makes a setting visible to every module; the step reads it
    as a global that its module does not hold, so no guard was made."""
    import builtins

    builtins.PTJ_TEST_SETTING = 2.0  # type: ignore[attr-defined]
    jitted = ptj.jit(_reads_a_builtin_setting)
    try:
        _like_eager(jitted, _reads_a_builtin_setting, (torch.ones(2),),
                    [lambda: setattr(builtins, "PTJ_TEST_SETTING", 5.0)])  # fmt: skip
    finally:
        del builtins.PTJ_TEST_SETTING  # type: ignore[attr-defined]
    assert jitted.num_traces == 2


HELD_GAIN = 2.0


def _held_gain(x: torch.Tensor) -> torch.Tensor:
    return x * HELD_GAIN


@dataclasses.dataclass
class _Ops:
    rhs: Callable[[torch.Tensor], torch.Tensor]


OPS = _Ops(_held_gain)
NESTED_REGISTRY = {"diffusion": {"rhs": _held_gain}}


class _Plain:
    pass


PLAIN_HOLDER = _Plain()
PLAIN_HOLDER.fn = _held_gain  # type: ignore[attr-defined]


def _calls_held_functions(x: torch.Tensor) -> torch.Tensor:
    return OPS.rhs(x) + NESTED_REGISTRY["diffusion"]["rhs"](x) + PLAIN_HOLDER.fn(x)  # type: ignore[attr-defined]


def test_functions_of_yours_held_two_levels_down_are_walked() -> None:
    """A function held by an object's attribute set after construction, a dataclass field or
    a registry of registries: the data walk guarded which function it is, but the code walk
    never read its globals."""
    _retraces_when_a_global_changes(_calls_held_functions, "HELD_GAIN", 5.0)


HOLDER_GAIN = 1.0


def _scaled_by_holder_gain(x: torch.Tensor) -> torch.Tensor:
    return x * HOLDER_GAIN


class _HandsOutTheHelper:
    @property
    def fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return _scaled_by_holder_gain


_HANDER = _HandsOutTheHelper()
HELPER_REF = weakref.ref(_scaled_by_holder_gain)
HELPER_PROXY = weakref.proxy(_HANDER)
HELPER_VAR = contextvars.ContextVar("helper", default=_scaled_by_holder_gain)
HELPER_VIEW = types.MappingProxyType({"fn": _scaled_by_holder_gain})
HELPER_CHAIN = collections.ChainMap({}, {"fn": _scaled_by_holder_gain})
HELPER_WEAK_VALUES = weakref.WeakValueDictionary({"fn": _scaled_by_holder_gain})
HELPER_FINALIZER = weakref.finalize(_HANDER, _scaled_by_holder_gain, torch.zeros(1))
HELPER_FINALIZER.atexit = False
HELPER_QUEUE: queue.Queue[Any] = queue.Queue()
HELPER_QUEUE.put(_scaled_by_holder_gain)


def _offset_gain(self: Any, x: torch.Tensor, offset: float) -> torch.Tensor:
    return x * HOLDER_GAIN + offset


class _WithPartialMethod:
    scaled = functools.partialmethod(_offset_gain, offset=0.5)


def _through_builtins(x: torch.Tensor) -> torch.Tensor:
    return PTJ_TEST_SCALE(x)  # type: ignore[name-defined]  # noqa: F821 (set on builtins)


@pytest.mark.parametrize(
    "step",
    [lambda x: HELPER_REF()(x), lambda x: HELPER_PROXY.fn(x), lambda x: HELPER_VAR.get()(x),
     lambda x: HELPER_VIEW["fn"](x), lambda x: HELPER_CHAIN["fn"](x),
     lambda x: HELPER_WEAK_VALUES["fn"](x), lambda x: HELPER_FINALIZER.peek()[1](x),
     lambda x: HELPER_QUEUE.queue[0](x), lambda x: _WithPartialMethod().scaled(x),
     _through_builtins],
    ids=["weakref.ref", "a property behind weakref.proxy", "a ContextVar's default",
         "a MappingProxyType", "a ChainMap's lower map", "a WeakValueDictionary",
         "a weakref.finalize", "a queue.Queue", "a partialmethod", "a name set on builtins"],
)  # fmt: skip
def test_a_helper_held_by_a_weak_reference_a_context_variable_or_a_mapping_view_is_walked(
    step: Callable[..., Any],
) -> None:
    """A function the step reaches through an object that holds it without being a
    container (``REF()(x)``, ``VAR.get()(x)``, ``VIEW["fn"](x)``, ``FIN.peek()[1](x)``, a
    queue's deque, a ``partialmethod``, ``builtins.SCALE = f``): its globals went
    unguarded, and the first value of ``HOLDER_GAIN`` was served for good (probes 38a,
    38c)."""
    builtins.PTJ_TEST_SCALE = _scaled_by_holder_gain  # type: ignore[attr-defined]
    try:
        _retraces_when_a_global_changes(step, "HOLDER_GAIN", 3.0)
    finally:
        del builtins.PTJ_TEST_SCALE  # type: ignore[attr-defined]


def test_a_function_replaced_in_a_queue_retraces() -> None:
    """``Q.queue[0] = other``: the library object's deque holds code of yours, guarded by
    what it holds (a ``LifoQueue``'s list was; a ``Queue``'s deque was not: probe 38c)."""
    jitted, step = ptj.jit(lambda x: HELPER_QUEUE.queue[0](x)), lambda x: HELPER_QUEUE.queue[0](x)
    try:
        _like_eager(jitted, step, (torch.ones(2),), [
            lambda: HELPER_QUEUE.queue.__setitem__(0, _other_helper)])  # fmt: skip
    finally:
        HELPER_QUEUE.queue[0] = _scaled_by_holder_gain
    assert jitted.num_traces == 2


class _Terms(dict):  # type: ignore[type-arg]
    """A dict subclass of yours holding functions."""


class _OrderedTerms(collections.OrderedDict):  # type: ignore[type-arg]
    pass


TERMS_MINE = _Terms(a=lambda x: x * 2, b=lambda x: x + 1)
ORDERED_TERMS = _OrderedTerms(a=lambda x: x * 2, b=lambda x: x + 1)
COUNTS = collections.Counter(a=2, b=3)


def _over_terms(x: torch.Tensor) -> torch.Tensor:
    for term in TERMS_MINE.values():  # the order counts: (x * 2) + 1 or (x + 1) * 2
        x = term(x)
    for term in ORDERED_TERMS.values():
        x = term(x)
    for name, count in COUNTS.items():
        x = x * 0.5 + count * (1.0 if name == "a" else 3.0)
    return x


def test_dict_subclasses_of_yours_and_a_counter_reordered_retrace() -> None:
    """A dict subclass of yours (or of ``OrderedDict``) reordered: only dicts of Python's own
    classes had their keys' order guarded; a ``Counter`` reordered: compared by its
    ``repr()``, which lists it by count (probe 38c)."""
    saved = dict(TERMS_MINE), dict(ORDERED_TERMS), dict(COUNTS)
    jitted = ptj.jit(_over_terms)
    try:
        _like_eager(jitted, _over_terms, (torch.ones(2),), [
            lambda: TERMS_MINE.__setitem__("a", TERMS_MINE.pop("a")),
            lambda: ORDERED_TERMS.move_to_end("a"),
            lambda: COUNTS.__setitem__("a", COUNTS.pop("a"))])  # fmt: skip
    finally:
        for held, items in zip((TERMS_MINE, ORDERED_TERMS, COUNTS), saved):
            held.clear(), held.update(items)
    assert jitted.num_traces <= 4  # (engines keeping a number as an input retrace less)


def _other_helper(x: torch.Tensor) -> torch.Tensor:
    return x - 1


def test_a_context_variable_set_to_another_helper_retraces() -> None:
    """The walk follows the context variable's value in the tracing call's context; set to
    another function later, the step calls that one."""
    jitted, step = ptj.jit(lambda x: HELPER_VAR.get()(x)), lambda x: HELPER_VAR.get()(x)
    token = None
    try:
        _like_eager(jitted, step, (torch.ones(2),), [
            lambda: globals().update(_token=HELPER_VAR.set(_other_helper))])  # fmt: skip
        token = globals().pop("_token")
    finally:
        if token is not None:
            HELPER_VAR.reset(token)
    assert jitted.num_traces == 2


class _Doubling(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.Tensor.add else out


def test_a_tensor_subclass_with_its_own_torch_function_runs_eagerly_warned() -> None:
    """Its ``__torch_function__`` is Python around every op; the captured program kept the
    ops and lost the doubling on every compiled call (no state changed at all)."""
    doubled = torch.ones(3).as_subclass(_Doubling)

    def step(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return (x + s).as_subclass(torch.Tensor)

    jitted = ptj.jit(step)
    # either reason (its own __torch_function__; as_subclass, an alias made without an op)
    with pytest.warns(ptj.JitWarning, match="__torch_function__ of its own|as_subclass"):
        for _ in range(4):
            torch.testing.assert_close(jitted(torch.ones(3), doubled), torch.full((3,), 4.0))
            jitted.wait_compiled()


def test_python_reading_requires_grad_retraces_when_a_parameter_is_frozen() -> None:
    """``if net.weight.requires_grad:`` (a frozen layer takes another path) and a branch on an
    intermediate's ``requires_grad`` (which follows the parameters'): the traced branch was
    kept after ``requires_grad_(False)`` on engine auto, whose compiled tier runs autograd as
    eager does without a retrace. Python's reads of ``requires_grad`` are noted in the record
    pass, and the module guard then checks the parameters' on every call."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))

    def step(x: torch.Tensor) -> torch.Tensor:
        scale = 2.0 if net[0].weight.requires_grad else 0.5
        y = net(x) * scale
        return y * 3 if y.requires_grad else y  # every parameter frozen: no graph

    def freeze(parameters: list[nn.Parameter], on: bool) -> Callable[[], None]:
        return lambda: [p.requires_grad_(on) for p in parameters] and None

    jitted, x = ptj.jit(step), torch.randn(4, 3)
    every = list(net.parameters())
    states = [lambda: None, freeze([net[0].weight], False), freeze(every, False),
              freeze(every, True)]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for change in states:
            change()
            for _ in range(4):  # engine auto's compiled tier serves the later calls
                torch.testing.assert_close(jitted(x), step(x))
                jitted.wait_compiled()
    assert jitted.num_traces == 3  # the first state's program serves the last one
    assert "requires_grad checked on every call: Python reads it at" in jitted.explain()


STAGE_WEIGHTS = {"a": 1.0, "b": 2.0}
KEY_SET = {1, 9}
SCALING = {"scale": 2, "coefficients": [1, 2]}
SIGNS = [0.0, 1]
OFFSET = 0.0
SHIFTS = (1,)
NESTED_SETS = {"ids": {1, 9}, "groups": [frozenset({1, 9})]}


def _over_stages(x: torch.Tensor) -> torch.Tensor:
    for w in STAGE_WEIGHTS.values():  # the order counts
        x = x * 0.5 + w
    for k in KEY_SET:
        x = x * 0.5 + k
    return x


def _over_nested_sets(x: torch.Tensor) -> torch.Tensor:
    for k in NESTED_SETS["ids"]:  # a set inside a dict: marshal writes it sorted
        x = x * 0.5 + k
    for k in NESTED_SETS["groups"][0]:  # a frozenset inside a list inside a dict
        x = x * 0.25 + k
    return x


def _typed_scaling(x: torch.Tensor) -> torch.Tensor:
    if isinstance(SCALING["scale"], int):  # an int keeps an integer tensor integer
        return x * SCALING["scale"] + SCALING["coefficients"][0] + SHIFTS[0]
    return x * SCALING["scale"] + 100.0


def _signed(x: torch.Tensor) -> torch.Tensor:
    a, b = SIGNS
    return x * math.copysign(1.0, a) * (2.0 if b is True else 1.0) + math.copysign(1.0, OFFSET)


def _rebuilt_set() -> set[int]:
    keys: set[int] = set()
    for k in (9, 1, 17):  # 9 and 17 collide: the set iterates 9, 1 (built 1, 9: 1, 9)
        keys.add(k)
    keys.discard(17)
    return keys


@pytest.mark.parametrize(
    ("step", "x", "changes"),
    [
        (_over_stages, torch.ones(2), [
            lambda: STAGE_WEIGHTS.__setitem__("a", STAGE_WEIGHTS.pop("a")),  # b, a
            lambda: (KEY_SET.clear(), KEY_SET.update(_rebuilt_set()))]),
        (_over_nested_sets, torch.ones(2), [
            lambda: (NESTED_SETS["ids"].clear(), NESTED_SETS["ids"].update(_rebuilt_set())),
            lambda: NESTED_SETS["groups"].__setitem__(0, frozenset(_rebuilt_set()))]),
        (_typed_scaling, torch.arange(3), [
            lambda: globals().__setitem__("SHIFTS", (1.0,)),
            lambda: SCALING.__setitem__("scale", 2.0),
            lambda: SCALING["coefficients"].__setitem__(0, 1.0)]),
        (_signed, torch.ones(2), [
            lambda: SIGNS.__setitem__(0, -0.0),
            lambda: SIGNS.__setitem__(1, True),
            lambda: globals().__setitem__("OFFSET", -0.0)]),
    ],
    ids=["a dict's and a set's order", "a set's order inside a dict or a list",
         "2 -> 2.0 in a tuple, a dict, a list", "-0.0, 1 -> True"],
)  # fmt: skip
def test_contents_equal_by_eq_but_read_otherwise_retrace(
    step: Callable[..., Any], x: torch.Tensor, changes: list[Callable[[], None]]
) -> None:
    """``==`` calls ``{"a": 1, "b": 2}`` and ``{"b": 2, "a": 1}`` equal, and ``[2]`` and
    ``[2.0]``, ``0.0`` and ``-0.0``, ``1`` and ``True``; a step looping over the values, or
    multiplying an integer tensor, does not. Contents (and floats) are compared as their
    ``repr()``."""
    saved = (dict(STAGE_WEIGHTS), set(KEY_SET), {**SCALING, "coefficients": [1, 2]},
             list(SIGNS), OFFSET, SHIFTS)  # fmt: skip
    nested = {"ids": {1, 9}, "groups": [frozenset({1, 9})]}
    NESTED_SETS.clear(), NESTED_SETS.update(nested)
    assert list(_rebuilt_set()) != list(KEY_SET)  # the premise: equal sets, another order
    assert list(frozenset(_rebuilt_set())) != list(NESTED_SETS["groups"][0])
    jitted = ptj.jit(step)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ptj.JitWarning)
            for change in [lambda: None, *changes]:
                change()
                for _ in range(3):
                    got, want = jitted(x), step(x)
                    assert got.dtype == want.dtype
                    torch.testing.assert_close(got, want)
                    jitted.wait_compiled()
    finally:
        STAGE_WEIGHTS.clear(), STAGE_WEIGHTS.update(saved[0])
        KEY_SET.clear(), KEY_SET.update(saved[1])
        SCALING.clear(), SCALING.update(saved[2])
        SIGNS[:] = saved[3]
        globals()["OFFSET"] = saved[4]
        globals()["SHIFTS"] = saved[5]
        NESTED_SETS.clear(), NESTED_SETS.update(nested)
    assert jitted.num_traces == 1 + len(changes)


NEXT_DT = iter([0.1, 0.2, 0.3, 0.4]).__next__
RANDOM = random.Random(0)


def _bound_next(x: torch.Tensor) -> torch.Tensor:
    return x * NEXT_DT()


def _own_generator(x: torch.Tensor) -> torch.Tensor:
    return x * RANDOM.uniform(0.0, 1.0)


@pytest.mark.parametrize(
    ("step", "match"),
    [(_bound_next, "reads an iterator"), (_own_generator, "random.Random.uniform")],
    ids=["an iterator's __next__ held", "a random.Random object of yours"],
)
def test_an_iterators_next_or_a_random_object_held_runs_eagerly_warned(
    step: Callable[..., Any], match: str
) -> None:
    """``NEXT_DT = iter(...).__next__`` and ``RNG = random.Random(0)`` held as globals: the
    first call's item or draw was baked in, with no warning (a bare iterator and Python's
    module-level ``random`` were seen)."""
    twin_next, twin_random = iter([0.1, 0.2, 0.3, 0.4]).__next__, random.Random(0)
    globals()["RANDOM"] = random.Random(0)
    globals()["NEXT_DT"] = iter([0.1, 0.2, 0.3, 0.4]).__next__
    jitted, x = ptj.jit(step), torch.ones(2)
    with pytest.warns(ptj.JitWarning, match=match) as caught:
        got = [jitted(x)[0].item() for _ in range(4)]
    twin = twin_next if step is _bound_next else lambda: twin_random.uniform(0.0, 1.0)
    assert got == pytest.approx([twin() for _ in range(4)])
    assert sum(issubclass(w.category, ptj.JitWarning) for w in caught) == 1


PACKED = bytearray(struct.pack("<f", 2.0))
PACKED_VIEW = memoryview(bytearray(b"\x02\x03"))


def _unpacks(x: torch.Tensor) -> torch.Tensor:
    return x * struct.unpack_from("<f", PACKED)[0] + len(PACKED) + sum(PACKED_VIEW)


def test_a_bytearray_or_memoryview_read_whole_is_guarded_by_content() -> None:
    """``struct.unpack_from(fmt, BUF)``, ``len(BUF)``, ``sum(memoryview)``: only indexed reads
    (``BUF[0]``) were guarded; the buffer itself by identity."""
    saved = bytes(PACKED), PACKED_VIEW.tobytes()

    def repack() -> None:
        PACKED[:] = struct.pack("<f", 5.0) + b"\x00"  # another value, one byte longer

    try:
        _like_eager(ptj.jit(_unpacks), _unpacks, (torch.ones(2),),
                    [repack, lambda: PACKED_VIEW.__setitem__(1, 9)])  # fmt: skip
    finally:
        PACKED[:] = saved[0]
        PACKED_VIEW[:] = saved[1]


class _Coarse:
    """Equal when ``a`` is: an ``__eq__`` comparing fewer fields than the step reads."""

    def __init__(self, a: float, b: float) -> None:
        self.a, self.b = a, b

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Coarse) and other.a == self.a

    def __hash__(self) -> int:
        return hash(self.a)


def _keyed(x: torch.Tensor, key: _Coarse, keys: frozenset[int]) -> torch.Tensor:
    for k in keys:  # the order counts
        x = x * 0.5 + k
    return x * key.a + key.b


def test_arguments_equal_by_their_eq_but_read_otherwise_are_keyed_apart() -> None:
    """A static argument of yours whose ``__eq__`` compares only some fields (``Key(1, 9)``
    after ``Key(1, 2)``, or ``b`` changed in place), and equal frozensets iterating in another
    order, were served the first call's program."""
    jitted, x = ptj.jit(_keyed), torch.ones(2)
    key, ordered = _Coarse(1.0, 2.0), frozenset([1, 9])
    reordered = frozenset([9, 1])
    assert ordered == reordered and list(ordered) != list(reordered)  # the premise
    calls = [(key, ordered), (_Coarse(1.0, 9.0), ordered), (key, reordered)]
    for args in [*calls, *calls]:
        torch.testing.assert_close(jitted(x, *args), _keyed(x, *args))
        jitted.wait_compiled()
    key.b = 4.0  # in place
    torch.testing.assert_close(jitted(x, key, ordered), _keyed(x, key, ordered))
    assert jitted.num_traces <= 4  # (engines keeping a number as an input retrace less)


class Source_:
    def __init__(self, a: float) -> None:
        self.a = a


ACTIVE = {Source_(1.0)}
STAGE_ARRAY = np.array([Source_(1.0), Source_(2.0)], dtype=object)
PARSER = configparser.ConfigParser()
PARSER.read_string("[solver]\nnu = 0.1\n")


class Term:
    WEIGHT = 0.5


class Diffusion(Term):
    pass


def _registries(x: torch.Tensor) -> torch.Tensor:
    for source in ACTIVE:
        x = x + source.a
    for stage in STAGE_ARRAY:
        x = x * stage.a
    x = x + sum(cls.WEIGHT for cls in Term.__subclasses__())
    return x * PARSER["solver"].getfloat("nu")


def test_objects_in_sets_object_arrays_subclass_registries_and_config_parsers_are_guarded() -> None:
    """Members of a set (``for s in self.active``) and of a NumPy object array, the classes
    ``Term.__subclasses__()`` lists (a plugin defined later), a ``ConfigParser``'s values
    (``CP.set(...)``): each was kept from the first call."""
    saved = PARSER.get("solver", "nu")
    plugins: list[type] = []

    def plugin() -> None:
        plugins.append(type("Drag", (Term,), {"WEIGHT": 2.0}))

    try:
        _like_eager(ptj.jit(_registries), _registries, (torch.ones(2),), [
            lambda: setattr(next(iter(ACTIVE)), "a", 3.0),
            lambda: setattr(STAGE_ARRAY[1], "a", 5.0),
            lambda: STAGE_ARRAY.__setitem__(0, Source_(4.0)),
            plugin,
            lambda: PARSER.set("solver", "nu", "0.3"),
        ])  # fmt: skip
    finally:
        next(iter(ACTIVE)).a = 1.0
        STAGE_ARRAY[:] = [Source_(1.0), Source_(2.0)]
        PARSER.set("solver", "nu", saved)
        plugins.clear()
        gc.collect()  # Drag leaves Term.__subclasses__()


class Component:
    def __init__(self, k: float) -> None:
        self.k = k


def test_a_weak_registry_grown_after_the_trace_retraces() -> None:
    """``WeakValueDictionary``/``WeakSet`` registries the step loops over: a component
    registered later was not seen (its members are not held: only how many)."""
    kept = [Component(1.0), Component(2.0)]
    by_name: weakref.WeakValueDictionary[str, Component] = weakref.WeakValueDictionary()
    members: weakref.WeakSet[Component] = weakref.WeakSet()
    by_name["a"] = kept[0]
    members.add(kept[0])

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * sum(c.k for c in by_name.values()) + sum(c.k for c in members)

    _like_eager(ptj.jit(step), step, (torch.ones(2),), [
        lambda: by_name.__setitem__("b", kept[1]), lambda: members.add(kept[1])])  # fmt: skip


class DeepParams:
    theta = 1.0


class DeepLimiter:
    def __init__(self) -> None:
        self.params = DeepParams()


class DeepStage:
    def __init__(self) -> None:
        self.limiter = DeepLimiter()


class DeepSolver:
    def __init__(self) -> None:
        self.stages = [DeepStage()]


class DeepSimulation:
    def __init__(self) -> None:
        self.solver = DeepSolver()

    def step(self, x: torch.Tensor) -> torch.Tensor:
        solver = self.solver  # through a local: not a spelled-out path
        return x * solver.stages[0].limiter.params.theta


def test_a_value_six_levels_under_self_is_guarded() -> None:
    """``sim.solver.stages[0].limiter.params.theta``: six levels of data under ``self``, one
    more than the walk went (it said so in a log line, but served the old value)."""
    sim = DeepSimulation()
    _like_eager(ptj.jit(sim.step), sim.step, (torch.ones(2),),
                [lambda: setattr(sim.solver.stages[0].limiter.params, "theta", 2.0)])  # fmt: skip


CONTROL_FILE = Path(tempfile.gettempdir()) / f"ptj_control_{os.getpid()}.json"


def _reads_a_control_file(x: torch.Tensor) -> torch.Tensor:
    with open(CONTROL_FILE) as handle:
        return x * json.load(handle)["gain"]


def test_a_file_read_in_the_step_runs_eagerly_warned() -> None:
    """A live-tunable control file read inside the step: its first content was baked in."""
    CONTROL_FILE.write_text('{"gain": 1.0}')
    jitted = ptj.jit(_reads_a_control_file)
    try:
        with pytest.warns(ptj.JitWarning, match="it reads files") as caught:
            first = jitted(torch.ones(2))
            CONTROL_FILE.write_text('{"gain": 2.0}')
            second = jitted(torch.ones(2))
    finally:
        CONTROL_FILE.unlink()
    assert first.tolist() == [1.0, 1.0] and second.tolist() == [2.0, 2.0]
    assert sum(issubclass(w.category, ptj.JitWarning) for w in caught) == 1


def _listed(folder: Path) -> int:
    return len(os.listdir(folder))


def _globbed(folder: Path) -> int:
    return len(glob.glob(str(folder / "*.txt")))


def _iterated(folder: Path) -> int:
    return sum(1 for _ in folder.iterdir())


def _scanned(folder: Path) -> int:
    with os.scandir(folder) as entries:
        return sum(1 for _ in entries)


def _exists(folder: Path) -> int:
    return 2 if os.path.exists(folder / "b.txt") else 1


def _sized(folder: Path) -> int:
    return os.path.getsize(folder / "a.txt")


def _stat(folder: Path) -> int:
    return os.stat(folder / "a.txt").st_size


@pytest.mark.parametrize(
    "count", [_listed, _globbed, _iterated, _scanned, _exists, _sized, _stat],
    ids=["os.listdir", "glob.glob", "Path.iterdir", "os.scandir", "os.path.exists",
         "os.path.getsize", "os.stat"],
)  # fmt: skip
def test_a_folder_listed_or_a_files_metadata_read_in_the_step_runs_eagerly_warned(
    count: Callable[[Path], int], tmp_path: Path
) -> None:
    """Probe 41c: reading a file ran eagerly, but listing a folder (``os.listdir``, ``glob``,
    ``Path.iterdir``, ``os.scandir``), testing that a file exists, or reading its size kept
    the first call's answer on every engine."""
    (tmp_path / "a.txt").write_text("a")
    step = lambda x: x * count(tmp_path)  # noqa: E731
    jitted = ptj.jit(step)
    with pytest.warns(ptj.JitWarning, match="it reads files") as caught:
        first = jitted(torch.ones(2))
        (tmp_path / "b.txt").write_text("b")
        (tmp_path / "a.txt").write_text("aaa")
        second = jitted(torch.ones(2))
    torch.testing.assert_close(first, torch.ones(2))
    torch.testing.assert_close(second, step(torch.ones(2)))
    assert sum(issubclass(w.category, ptj.JitWarning) for w in caught) == 1


BIG_TABLE = {f"k{i}": float(i) for i in range(300)}
BIG_INTS = list(range(3000))


def _over_big_contents(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    weighted = sum(w * 0.5 ** (i % 8) for i, w in enumerate(BIG_TABLE.values()))  # its order
    return x * weighted, torch.full((3,), BIG_INTS[0])  # an int64 tensor, or a float one


@pytest.mark.all_engines
def test_contents_of_thousands_of_items_equal_by_eq_but_read_otherwise_retrace() -> None:
    """Probe 47: contents of more than 256 items were compared by ``==``; a dict of 300
    entries reordered (one popped and put back) and ``L[0] = 0.0`` in a list of 3000 ints
    kept the first program, on every engine. All contents guarded by content (up to 4096
    items) are now compared in canonical form."""
    saved_table, saved_ints = dict(BIG_TABLE), list(BIG_INTS)

    def reorder() -> None:
        BIG_TABLE["k0"] = BIG_TABLE.pop("k0")

    try:
        like_eager_after_each(ptj.jit(_over_big_contents), lambda f: f(torch.ones(2)),
                              _over_big_contents,
                              [reorder, lambda: BIG_INTS.__setitem__(0, 0.0)])  # fmt: skip
    finally:
        BIG_TABLE.clear(), BIG_TABLE.update(saved_table)
        BIG_INTS[:] = saved_ints


UNITS = {"scale": 2.0}


@dataclasses.dataclass
class _Material:
    stiffness: float = 2.0
    density: float = dataclasses.field(default=1.0, metadata=UNITS)


MATERIAL = _Material()


def _scaled_by_field_metadata(x: torch.Tensor) -> torch.Tensor:
    for field in dataclasses.fields(MATERIAL):  # through Python's library, not a spelled path
        x = x * getattr(MATERIAL, field.name) * field.metadata.get("scale", 1.0)
    return x + dataclasses.fields(_Material)[0].default


@pytest.mark.all_engines
def test_a_dataclass_fields_defaults_and_metadata_read_through_fields_are_guarded() -> None:
    """Probe 47: ``dataclasses.fields()`` returns the ``Field`` objects a dataclass keeps in
    ``__dataclass_fields__``, which the walk took for Python's own; a metadata dict of yours
    changed in place, or a field's default replaced, kept the first value on every engine."""
    field = _Material.__dataclass_fields__["stiffness"]

    def restore() -> None:
        UNITS["scale"], field.default = 2.0, 2.0

    try:
        like_eager_after_each(ptj.jit(_scaled_by_field_metadata),
                              lambda f: f(torch.ones(2)), _scaled_by_field_metadata,
                              [lambda: UNITS.__setitem__("scale", 3.0),
                               lambda: setattr(field, "default", 5.0)])  # fmt: skip
    finally:
        restore()


FRAME_K = 2.0


def _by_own_frame(x: torch.Tensor) -> torch.Tensor:
    return x * sys._getframe(0).f_globals["FRAME_K"]


def _by_inspected_frame(x: torch.Tensor) -> torch.Tensor:
    frame = inspect.currentframe()
    assert frame is not None
    return x * frame.f_globals["FRAME_K"]


def _through_frames(x: torch.Tensor) -> torch.Tensor:
    return _by_own_frame(x) + _by_inspected_frame(x)


@pytest.mark.all_engines
def test_a_global_read_through_the_helpers_own_frame_is_guarded() -> None:
    """Probe 47: ``sys._getframe(0).f_globals["K"]`` and ``inspect.currentframe().f_globals``
    in a helper read its module's globals by name, as ``globals()["K"]`` does; they kept the
    first value on every engine."""
    try:
        like_eager_after_each(ptj.jit(_through_frames), lambda f: f(torch.ones(2)),
                              _through_frames,
                              [lambda: globals().__setitem__("FRAME_K", 3.0)])  # fmt: skip
    finally:
        globals()["FRAME_K"] = 2.0
