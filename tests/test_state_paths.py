"""Python state a step reads through attributes (guarded, never stale) and state it changes
(eager with one warning, side effects once per call), on every engine: NOTE [attribute
paths], NOTE [side effects of the step]."""

from __future__ import annotations

import argparse
import dataclasses
import types
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines


def _stays_like_eager(f: Callable[[torch.Tensor], Any], change: Callable[[], None]) -> Any:
    """Jit ``f``, call it twice, apply ``change``, call again: equal to eager every time."""
    x = torch.linspace(1, 2, 3)
    jitted = ptj.jit(f)
    for _ in range(2):
        torch.testing.assert_close(jitted(x), f(x))
    change()
    for _ in range(2):
        torch.testing.assert_close(jitted(x), f(x))
    return jitted


class Settings:
    dt = 0.1


@dataclasses.dataclass
class Solver:
    damping: float = 0.5
    iterations: int = 3


CFG = types.SimpleNamespace(dt=0.1, solver=Solver(), weight=torch.ones(3))
ARGS = argparse.Namespace(lr=0.1)
TABLE = {"solver": {"iterations": 3, "note": object()}, **{f"k{i}": i for i in range(40)}}


@pytest.fixture(autouse=True)
def _fresh_config() -> None:
    """Each engine's run starts from the same configuration."""
    CFG.dt, CFG.solver, ARGS.lr, Settings.dt = 0.1, Solver(), 0.1, 0.1
    TABLE["solver"]["iterations"] = 3


@pytest.mark.parametrize(
    ("read", "change", "reason"),
    [
        (lambda x: x * CFG.dt, lambda: setattr(CFG, "dt", 0.05), ("global CFG.dt", "0.1 -> 0.05")),
        (lambda x: x * CFG.solver.damping, lambda: setattr(CFG.solver, "damping", 0.25),
         ("global CFG.solver.damping", "0.5 -> 0.25")),
        (lambda x: x * ARGS.lr, lambda: setattr(ARGS, "lr", 0.3), ("global ARGS.lr", "0.1 -> 0.3")),
        (lambda x: x * Settings.dt, lambda: setattr(Settings, "dt", 0.2),
         ("global Settings.dt", "0.1 -> 0.2")),
        (lambda x: x * Settings().dt, lambda: setattr(Settings, "dt", 0.3),
         ("global Settings.dt", "-> 0.3")),
        (lambda x: x * TABLE["solver"]["iterations"],
         lambda: TABLE["solver"].__setitem__("iterations", 5),
         ("global TABLE['solver']['iterations']", "3 -> 5")),
    ],
)  # fmt: skip
def test_config_read_through_attributes_and_entries_retraces_naming_the_path(
    read: Any, change: Any, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="phi_torch_jit"):
        jitted = _stays_like_eager(read, change)
    assert jitted.num_traces == 2
    path, values = reason
    assert any(path in r.getMessage() and values in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]


def test_a_tensor_on_a_config_object_is_an_input_updated_in_place_or_rebound() -> None:
    config = types.SimpleNamespace(weight=torch.ones(3))
    jitted = _stays_like_eager(lambda x: x * config.weight, lambda: config.weight.mul_(3))
    _stays_like_eager(
        lambda x: x * config.weight, lambda: setattr(config, "weight", -config.weight)
    )
    assert jitted.num_traces == 1


def test_a_model_replaced_in_a_container_or_on_an_object_is_seen() -> None:
    first, second = nn.Linear(3, 3), nn.Linear(3, 3)
    holder = {"model": first}
    models = [first]
    owner = types.SimpleNamespace(model=first)
    _stays_like_eager(lambda x: holder["model"](x), lambda: holder.__setitem__("model", second))
    _stays_like_eager(lambda x: models[0](x), lambda: models.__setitem__(0, second))
    _stays_like_eager(lambda x: owner.model(x), lambda: setattr(owner, "model", second))


def test_namespace_arguments_are_keyed_by_their_attributes() -> None:
    jitted = ptj.jit(lambda x, cfg: x * cfg.dt)
    x = torch.ones(2)
    for cfg in (argparse.Namespace(dt=0.1), types.SimpleNamespace(dt=0.1)):
        torch.testing.assert_close(jitted(x, cfg), x * 0.1)
        cfg.dt = 0.5
        torch.testing.assert_close(jitted(x, cfg), x * 0.5)
    assert jitted.num_traces == 4  # two types, two values


# Steps that change Python state ------------------------------------------------------------

STATE = {"t": 0}
HISTORY: list[float] = []
COUNTS = {"forward": 0}


def _advance(x: torch.Tensor) -> torch.Tensor:
    STATE["t"] += 1
    return x / STATE["t"]


def _log(x: torch.Tensor) -> torch.Tensor:
    HISTORY.append(1.0)
    return x * len(HISTORY)


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x) * (2 if self.calls % 2 else 1)


class _CountedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        COUNTS["forward"] += 1
        return x * COUNTS["forward"]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _reset() -> None:
    STATE["t"] = 0
    HISTORY.clear()
    COUNTS["forward"] = 0


@pytest.mark.parametrize("case", ["dict counter", "append", "module counter", "Function counter"])
def test_a_step_that_changes_state_runs_eagerly_once_per_call_with_one_warning(case: str) -> None:
    module = _Counting()
    steps: dict[str, tuple[Callable[[torch.Tensor], Any], Callable[[], Any]]] = {
        "dict counter": (_advance, lambda: STATE["t"]),
        "append": (_log, lambda: len(HISTORY)),
        "module counter": (lambda x: module(x), lambda: module.calls),
        "Function counter": (lambda x: _CountedFunction.apply(x), lambda: COUNTS["forward"]),
    }
    step, counter = steps[case]
    x = torch.ones(3)
    _reset()
    module.calls = 0
    want = [step(x) for _ in range(4)]
    assert counter() == 4
    _reset()
    module.calls = 0
    jitted = ptj.jit(step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [jitted(x) for _ in range(4)]
    torch.testing.assert_close(got, want)
    assert counter() == 4  # once per call, never twice
    assert jitted.num_traces == 1  # no retrace loop
    (warning,) = [w for w in caught if issubclass(w.category, ptj.JitWarning)]
    assert "it changes Python state it reads" in str(warning.message)
    assert "pass it in as an argument and return its new value" in str(warning.message)


class _Node:
    """A user object with many attributes (a simulation's state, say)."""


def _tree(depth: int) -> _Node:
    node = _Node()
    for i in range(30):
        setattr(node, f"a{i}", _tree(depth - 1) if depth else float(i))
    return node


BIG = _tree(2)


def test_a_path_read_in_the_code_is_guarded_even_in_objects_beyond_the_walks_budget() -> None:
    BIG.a29.a28.a27 = 27.0
    jitted = _stays_like_eager(
        lambda x: x * BIG.a29.a28.a27, lambda: setattr(BIG.a29.a28, "a27", 3.0)
    )
    assert jitted.num_traces == 2
    # bounded: the walk's 512 (_reads._python._MAX_FIELDS), the path spelled, and what the
    # record pass saw read past the budget (_reads._overflow: 3 objects, 3 attributes)
    assert len(jitted.specializations[0].python_guard or ()) <= 512 + 1 + 3 + 9


class _Touchy:
    """A config whose attribute access raises once it is closed (a user's own rule)."""

    def __init__(self) -> None:
        self.closed = False
        self.dt = 0.1

    def __getattribute__(self, name: str) -> Any:
        if name == "dt" and object.__getattribute__(self, "closed"):
            raise RuntimeError("configuration closed")
        return object.__getattribute__(self, name)


def test_a_guard_whose_read_raises_retraces_and_the_error_is_eagers() -> None:
    config = _Touchy()
    jitted = ptj.jit(lambda x: x * config.dt)
    x = torch.ones(2)
    torch.testing.assert_close(jitted(x), x * 0.1)
    jitted(x)
    config.closed = True
    with pytest.raises(RuntimeError, match="configuration closed"):
        jitted(x)
    config.closed = False
    torch.testing.assert_close(jitted(x), x * 0.1)
