"""Counters no code of the step reads (_reads._unread): an attribute that changed between
calls is watched in the retrace's record pass; one that pass does not read is not guarded by
the new specialization. ``model.num_updates += 1``, ``trainer.global_step += 1``,
``cfg.history.append(loss)`` in an ordinary loop retraced every call, and after 12 calls the
step ran eagerly for good (probe rounds 26-27). Attributes read in any way (a name held in a
variable, ``operator.attrgetter``, ``str.format``, ``match``, a library's code, ``vars``) stay
guarded: the watch sees every read that goes through the class."""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines


class _Counted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.scale = 2.0
        self.num_updates = 0
        self.history: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class _Trainer:
    def __init__(self) -> None:
        self.net = _Counted()
        self.dt = 0.1
        self.global_step = 0
        self.losses: list[float] = []

    def step(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.dt


class _Config:
    def __init__(self) -> None:
        self.k = 0.5
        self.iteration = 0
        self.log: list[int] = []


_X = torch.linspace(0.5, 1.5, 3)


def _calls(jitted: Any, eager: Any, count: Callable[[int], None], n: int = 6) -> None:
    for i in range(n):
        torch.testing.assert_close(jitted(_X), eager(_X))
        count(i)


def test_a_modules_counters_retrace_once_then_not_again() -> None:
    """A plain attribute (the module guard's) and a list (the Python guard's) that the
    forward never reads: the first change retraces with them watched, later ones do not;
    ``scale``, which the forward reads, still retraces."""
    model = _Counted()
    jitted = ptj.jit(model)

    def count(i: int) -> None:
        model.num_updates += 1
        model.history.append(float(i))

    _calls(jitted, model, count)
    assert jitted.num_traces == 2, jitted.explain()
    model.scale = 3.0
    _calls(jitted, model, count, 2)
    assert jitted.num_traces == 3, jitted.explain()


def test_a_trainers_step_counter_retraces_its_jitted_method_once() -> None:
    trainer = _Trainer()
    jitted = ptj.jit(trainer.step)

    def count(i: int) -> None:
        trainer.global_step += 1
        trainer.losses.append(float(i))

    _calls(jitted, trainer.step, count)
    assert jitted.num_traces == 2, jitted.explain()
    trainer.dt = 0.2
    _calls(jitted, trainer.step, count, 2)
    assert jitted.num_traces == 3, jitted.explain()


def test_a_configs_counter_and_log_retrace_once() -> None:
    cfg = _Config()

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * cfg.k

    jitted = ptj.jit(step)

    def count(i: int) -> None:
        cfg.iteration += 1
        cfg.log.append(i)

    _calls(jitted, step, count)
    assert jitted.num_traces == 2, jitted.explain()
    cfg.k = 0.25
    _calls(jitted, step, count, 2)
    assert jitted.num_traces == 3, jitted.explain()


_CFG = _Config()
_NAME = "k"
_GET_K = operator.attrgetter("k")
_FORMAT = "{0.k}"
_FORMATTER = logging.Formatter("%(k)s")


def _matched(x: torch.Tensor) -> torch.Tensor:
    match _CFG:
        case _Config(k=k):
            return x * k
    return x


READ_ANOTHER_WAY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "by a name held in a variable": lambda x: x * getattr(_CFG, _NAME),
    "by an attrgetter made outside the step": lambda x: x * _GET_K(_CFG),
    "by a format string": lambda x: x * float(_FORMAT.format(_CFG)),
    "by a library's formatter (its __dict__)": lambda x: x * float(_FORMATTER.formatMessage(_CFG)),  # type: ignore[arg-type]
    "through vars()": lambda x: x * vars(_CFG)["k"],
    "by a class pattern": _matched,
    "by a sort key": lambda x: x * max([_CFG], key=_GET_K).k,
}


@pytest.mark.parametrize("case", list(READ_ANOTHER_WAY))
def test_an_attribute_read_another_way_stays_guarded_after_it_changed(case: str) -> None:
    """The attribute changes twice: after each change the step equals eager. The first
    change retraces (every attribute is guarded until one changes); the watched record pass
    sees the read, so the second retraces too."""
    step = READ_ANOTHER_WAY[case]
    jitted = ptj.jit(step)
    try:
        for k in (0.5, 2.0, 3.0):
            _CFG.k = k
            for _ in range(3):
                torch.testing.assert_close(jitted(_X), step(_X))
    finally:
        _CFG.k = 0.5
    assert jitted.num_traces == 3, jitted.explain()


def test_an_attribute_the_step_reads_only_sometimes_is_guarded_where_read() -> None:
    """``cfg.k`` read only while ``cfg.iteration`` is below 3: a path that does not read it
    drops its guard, the path that does keeps it (the branch itself is guarded)."""
    cfg = _Config()

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * cfg.k if cfg.iteration < 3 else x

    jitted = ptj.jit(step)
    for i in range(6):
        cfg.iteration = i
        cfg.k = 0.5 + i
        torch.testing.assert_close(jitted(_X), step(_X))
    cfg.iteration = 0
    for k in (5.0, 6.0):
        cfg.k = k
        torch.testing.assert_close(jitted(_X), step(_X))


class _Reversed(torch.autograd.Function):
    """A gradient-reversal layer scaled by a config read only in its backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return -grad * _BACKWARD.k


_BACKWARD = _Config()


class _Namespace(__import__("types").SimpleNamespace):
    pass


_HP, _REFERENCE = _Namespace(k=1.0), _Namespace(k=1.0)


def test_attributes_read_where_the_watch_cannot_see_stay_guarded() -> None:
    """Three reads the record pass does not see: a custom function's backward (it runs at
    the first backward, after the pass), ``==`` of a ``SimpleNamespace`` subclass (C code
    reading the instance's dict), ``object.__getattribute__`` spelled out. Each changes
    three times and stays like eager (probe 28f found each stale after the second change)."""
    weight = torch.ones(3, requires_grad=True)

    def backward_step(x: torch.Tensor) -> torch.Tensor:
        return _Reversed.apply(x * weight).sum()  # type: ignore[no-any-return]

    def compared(x: torch.Tensor) -> torch.Tensor:
        return x * (1.0 if _HP == _REFERENCE else 10.0)

    def bypassed(x: torch.Tensor) -> torch.Tensor:
        return x * object.__getattribute__(_CFG, "k")

    jitted = [ptj.jit(backward_step), ptj.jit(compared), ptj.jit(bypassed)]
    try:
        for value in (0.5, 2.0, 0.5, 3.0):
            _BACKWARD.k, _HP.k, _CFG.k = value, value * 2, value
            for _ in range(2):
                weight.grad = None
                jitted[0](_X).backward()
                got = weight.grad.clone()
                weight.grad = None
                backward_step(_X).backward()
                torch.testing.assert_close(got, weight.grad)
                torch.testing.assert_close(jitted[1](_X), compared(_X))
                torch.testing.assert_close(jitted[2](_X), bypassed(_X))
    finally:
        _BACKWARD.k, _HP.k, _CFG.k = 0.5, 1.0, 0.5


_GET = object.__getattribute__  # held under a name of the user's


class _Slot:
    __slots__ = ("k",)

    def __init__(self) -> None:
        self.k = 0.5


_SLOT = _Slot()


_BOUND_GET = _CFG.__getattribute__  # a method-wrapper bound to the config, held


@pytest.mark.parametrize(
    "case", ["getattr_static", "slot descriptor", "held bypass", "bound getattribute"]
)
def test_reads_past_the_class_under_other_names_keep_the_attribute_guarded(case: str) -> None:
    """Probe round 35: ``inspect.getattr_static``, a slot descriptor's ``__get__`` and
    ``object.__getattribute__`` held under another name read past the watch; after one change
    the retrace counted the attribute as unread and dropped its guard: stale from then on."""
    import inspect

    def static(x: torch.Tensor) -> torch.Tensor:
        return x * inspect.getattr_static(_CFG, "k")

    def descriptor(x: torch.Tensor) -> torch.Tensor:
        return x * _Slot.__dict__["k"].__get__(_SLOT, _Slot)

    def held(x: torch.Tensor) -> torch.Tensor:
        return x * _GET(_CFG, "k")

    def bound(x: torch.Tensor) -> torch.Tensor:
        return x * _BOUND_GET("k")

    steps = {"getattr_static": static, "slot descriptor": descriptor, "held bypass": held,
             "bound getattribute": bound}  # fmt: skip
    step = steps[case]
    holder = _SLOT if case == "slot descriptor" else _CFG
    jitted = ptj.jit(step)
    try:
        for value in (0.5, 3.0, 10.0, 0.5):
            holder.k = value
            for _ in range(2):
                torch.testing.assert_close(jitted(_X), _X * value)
    finally:
        _CFG.k = _SLOT.k = 0.5
