"""State held behind objects of Python's and NumPy's own types (_reads._fields): a builtin
method bound to a dict, list or array (``LOOK = TABLE.get``), a ``ChainMap``'s lower maps, a
``contextvars.Context`` and a ``ContextVar`` that held no value, a masked array's mask,
``os.environ`` under another name, ``sys.argv``. Each was found silently wrong by a probe:
the program kept what it had traced."""

from __future__ import annotations

import collections
import contextvars
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from helpers import like_eager_then_retraced

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines

TABLE = {"k": 1.0}
ITEMS = [1.0, 2.0]
ARRAY = np.array([1.0, 2.0])
LOOK = TABLE.get
ITEM = ITEMS.__getitem__
TOTAL = ARRAY.sum


def _set(container: Any, key: Any, value: Any) -> Callable[[], None]:
    def change() -> None:
        container[key] = value

    return change


@pytest.mark.parametrize(
    ("step", "change"),
    [
        (lambda x: x * LOOK("k"), _set(TABLE, "k", 3.0)),
        (lambda x: x * ITEM(0), _set(ITEMS, 0, 5.0)),
        (lambda x: x * float(TOTAL()), _set(ARRAY, 0, 4.0)),
    ],
    ids=["dict.get", "list.__getitem__", "ndarray.sum"],
)
def test_a_builtin_method_held_reads_its_objects_state(
    step: Callable[[torch.Tensor], torch.Tensor], change: Callable[[], None]
) -> None:
    saved = dict(TABLE), list(ITEMS), ARRAY.copy()
    try:
        like_eager_then_retraced(ptj.jit(step), step, change)
    finally:
        TABLE.update(saved[0])
        ITEMS[:] = saved[1]
        ARRAY[:] = saved[2]


def test_a_chain_maps_lower_maps_are_read() -> None:
    lower = {"k": 1.0, "j": 2.0}
    chain = collections.ChainMap({}, lower)

    def step(x: torch.Tensor) -> torch.Tensor:
        c = chain  # a local alias: no path spells the read
        return x * c.get("k", 0.0) + sum(c.values())

    like_eager_then_retraced(ptj.jit(step), step, _set(lower, "k", 4.0))
    like_eager_then_retraced(
        ptj.jit(step), step, lambda: chain.maps.insert(0, {"k": 11.0}), traces=2
    )


VAR: contextvars.ContextVar[float] = contextvars.ContextVar("test_reads_builtin_holders_var")


def test_a_context_variable_that_held_no_value_when_traced() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return x * VAR.get(2.0)

    context = contextvars.copy_context()  # set in a context of its own: others see no value

    def run() -> None:
        like_eager_then_retraced(ptj.jit(step), step, lambda: VAR.set(5.0))

    context.run(run)


def test_a_context_held_is_read_by_its_entries() -> None:
    context = contextvars.Context()

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * context.get(VAR, 1.0)

    like_eager_then_retraced(ptj.jit(step), step, lambda: context.run(VAR.set, 4.0))


def test_a_masked_arrays_mask_is_compared_besides_its_data() -> None:
    masked = np.ma.masked_array([1.0, 2.0], mask=[False, False])

    def step(x: torch.Tensor) -> torch.Tensor:
        return x + float(masked.sum())

    like_eager_then_retraced(ptj.jit(step), step, _set(masked.mask, 0, True))


ENV = os.environ


def test_the_environment_under_another_name_is_read(monkeypatch: Any) -> None:
    monkeypatch.setenv("PHI_TORCH_JIT_TEST_SCALE", "1.0")

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * float(ENV.get("PHI_TORCH_JIT_TEST_SCALE", "1.0"))

    like_eager_then_retraced(
        ptj.jit(step), step, lambda: monkeypatch.setenv("PHI_TORCH_JIT_TEST_SCALE", "3.0")
    )


def test_the_command_line_changed_in_place_is_read(monkeypatch: Any) -> None:
    monkeypatch.setattr(sys, "argv", ["prog", "1.0"])

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * float(sys.argv[1])

    like_eager_then_retraced(ptj.jit(step), step, _set(sys.argv, 1, "4.0"))


@pytest.mark.parametrize("how", ["expandvars", "expanduser"])
def test_the_environment_read_by_pythons_path_helpers_is_read(how: str, monkeypatch: Any) -> None:
    monkeypatch.setenv("PHI_TORCH_JIT_TEST_DIR", "/tmp/a")
    monkeypatch.setenv("HOME", "/tmp/a")

    def step(x: torch.Tensor) -> torch.Tensor:
        path = os.path.expandvars("$PHI_TORCH_JIT_TEST_DIR") if how == "expandvars" else (
            os.path.expanduser("~"))  # fmt: skip
        return x * len(path)

    def change() -> None:
        monkeypatch.setenv("PHI_TORCH_JIT_TEST_DIR", "/tmp/abcdef")
        monkeypatch.setenv("HOME", "/tmp/abcdef")

    like_eager_then_retraced(ptj.jit(step), step, change)


def test_the_command_line_parsed_by_argparse_is_read(monkeypatch: Any) -> None:
    import argparse

    monkeypatch.setattr(sys, "argv", ["prog", "1.0"])
    parser = argparse.ArgumentParser()
    parser.add_argument("k", type=float)

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * parser.parse_args().k

    like_eager_then_retraced(ptj.jit(step), step, _set(sys.argv, 1, "5.0"))
