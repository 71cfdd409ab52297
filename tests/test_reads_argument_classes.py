"""The classes arguments bring along (_signature.classes_in): an enum member, a frozen
dataclass, a NamedTuple, a class passed itself. Their instances are keyed by value; what
their methods read (their module's globals, the class's constants and methods) was not
guarded, so the program kept what it had traced (found by a probe)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import argument_classes as classes
import pytest
import torch

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines


def _like_eager_then_retraced(argument: Any, change: Callable[[], None]) -> None:
    """Three calls with ``argument``, ``change()``, three calls: each like eager, no
    JitWarning, and two traces in all."""
    jitted = ptj.jit(lambda x, a: a.apply(x))
    x = torch.linspace(0.5, 1.5, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for each in (lambda: None, change):
            each()
            for _ in range(3):
                torch.testing.assert_close(jitted(x, argument), argument.apply(x))
            jitted.wait_compiled()
            torch.testing.assert_close(jitted(x, argument), argument.apply(x))
    assert jitted.num_traces == 2, jitted.explain()


ARGUMENTS = {
    "enum member": classes.Mode.A,
    "frozen dataclass": classes.Settings(1.5),
    "namedtuple": classes.Pair(1.5),
    "class": classes.Solver,
}


@pytest.fixture
def restored() -> Any:
    saved = classes.GAIN, classes.Settings.SCALE, classes.Solver.K, classes.Mode.apply
    yield
    classes.GAIN, classes.Settings.SCALE, classes.Solver.K = saved[:3]
    classes.Mode.apply = saved[3]  # type: ignore[method-assign]


@pytest.mark.parametrize("name", list(ARGUMENTS))
def test_a_global_the_arguments_method_reads_is_guarded(name: str, restored: Any) -> None:
    _like_eager_then_retraced(ARGUMENTS[name], lambda: setattr(classes, "GAIN", 3.0))


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("frozen dataclass", lambda: setattr(classes.Settings, "SCALE", 4.0)),
        ("class", lambda: setattr(classes.Solver, "K", 5.0)),
        ("enum member", lambda: setattr(classes.Mode, "apply", lambda self, x: x * 9.0)),
    ],
    ids=["class constant", "class passed", "method replaced"],
)
def test_the_arguments_class_is_guarded(name: str, change: Any, restored: Any) -> None:
    _like_eager_then_retraced(ARGUMENTS[name], change)
