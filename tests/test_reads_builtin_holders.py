"""State held behind objects of Python's and NumPy's own types (_reads._fields): a builtin
method bound to a dict, list or array (``LOOK = TABLE.get``), a ``ChainMap``'s lower maps, a
``contextvars.Context`` and a ``ContextVar`` that held no value, a masked array's mask,
``os.environ`` under another name or read by a library's function, the working directory,
``sys.argv``. Each was found silently wrong by a probe:
the program kept what it had traced."""

from __future__ import annotations

import collections
import contextvars
import operator
import os
import pathlib
import shutil
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


GET_ENVIRONMENT = operator.attrgetter("environ")


@pytest.mark.parametrize("how", ["home", "which", "exec_path", "getattr", "attrgetter"])
def test_the_environment_read_by_library_functions_or_by_name_is_read(
    how: str, monkeypatch: Any, tmp_path: Any
) -> None:
    """Code that never names ``environ``/``getenv``: ``Path.home()`` reads ``HOME``,
    ``shutil.which`` and ``os.get_exec_path()`` read ``PATH``; ``getattr(os, "environ")`` and an
    ``attrgetter("environ")`` reach it by a string (probe 50: every engine kept the trace)."""
    (tmp_path / "b").mkdir()
    tool = tmp_path / "b" / "ptj-probe-tool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("HOME", "/tmp/a")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("PHI_TORCH_JIT_TEST_SCALE", "1.0")

    def step(x: torch.Tensor) -> torch.Tensor:
        if how == "home":
            return x * len(str(pathlib.Path.home()))
        if how == "which":
            return x * (2.0 if shutil.which("ptj-probe-tool") else 1.0)
        if how == "exec_path":
            return x * len(os.get_exec_path())
        held = getattr(os, "environ") if how == "getattr" else GET_ENVIRONMENT(os)  # noqa: B009
        return x * float(held["PHI_TORCH_JIT_TEST_SCALE"])

    def change() -> None:
        monkeypatch.setenv("HOME", "/tmp/abcdef")
        monkeypatch.setenv("PATH", f"{tmp_path}:{tmp_path / 'b'}")
        monkeypatch.setenv("PHI_TORCH_JIT_TEST_SCALE", "3.0")

    like_eager_then_retraced(ptj.jit(step), step, change)


@pytest.mark.parametrize("how", ["getcwd", "abspath", "resolve"])
def test_the_working_directory_is_read(how: str, monkeypatch: Any, tmp_path: Any) -> None:
    """``os.getcwd()``, ``os.path.abspath``, ``Path.resolve()``: an ``os.chdir`` between calls
    changes what they return (probe 50)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "abcdef").mkdir()
    monkeypatch.chdir(tmp_path / "a")

    def step(x: torch.Tensor) -> torch.Tensor:
        if how == "getcwd":
            return x * len(os.getcwd())
        if how == "abspath":
            return x * len(os.path.abspath("data"))
        return x * len(str(pathlib.Path("data").resolve()))

    like_eager_then_retraced(ptj.jit(step), step, lambda: monkeypatch.chdir(tmp_path / "abcdef"))


def test_the_command_line_parsed_by_argparse_is_read(monkeypatch: Any) -> None:
    import argparse

    monkeypatch.setattr(sys, "argv", ["prog", "1.0"])
    parser = argparse.ArgumentParser()
    parser.add_argument("k", type=float)

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * parser.parse_args().k

    like_eager_then_retraced(ptj.jit(step), step, _set(sys.argv, 1, "5.0"))


REDUCE = max
OPS = {"reduce": max}
XP: Any = np
CONF: contextvars.ContextVar[dict[str, float]] = contextvars.ContextVar(
    "test_reads_builtin_holders_conf",
    default={"k": 2.0},  # noqa: B039 (what the test reads)
)


class _Settings:
    def __init__(self) -> None:
        self.reduce = max


@pytest.mark.parametrize("where", ["global", "closure", "dict", "attribute"])
def test_a_variable_holding_one_of_pythons_builtins_rebound_retraces(where: str) -> None:
    """``REDUCE = max`` then ``REDUCE = min``, in a global, a closure, a dict, an object's
    attribute: Python's builtins are never rebound, but a variable holding one is; which one
    it holds is compared (probe 43a). A name Python resolves in its builtins is not read."""
    global REDUCE
    reduce, settings = max, _Settings()
    steps = {
        "global": lambda x: x * REDUCE(x.shape[0], 2),
        "closure": lambda x: x * reduce(x.shape[0], 2),
        "dict": lambda x: x * OPS["reduce"](x.shape[0], 2),
        "attribute": lambda x: x * settings.reduce(x.shape[0], 2),
    }
    step = steps[where]

    def change() -> None:
        global REDUCE
        nonlocal reduce
        if where == "global":
            REDUCE = min
        elif where == "closure":
            reduce = min
        elif where == "dict":
            OPS["reduce"] = min
        else:
            settings.reduce = min

    try:
        like_eager_then_retraced(ptj.jit(step), step, change)
    finally:
        REDUCE = OPS["reduce"] = max


def test_a_variable_holding_a_librarys_module_rebound_retraces() -> None:
    """``XP = np`` then ``XP = torch``, a backend chosen at run time (probe 43a)."""
    global XP

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * (2.0 if XP is np else 3.0) + float(XP.ones(1)[0])

    def change() -> None:
        global XP
        XP = torch

    try:
        like_eager_then_retraced(ptj.jit(step), step, change)
    finally:
        XP = np


def test_the_content_of_a_context_variables_default_is_read() -> None:
    """A ``ContextVar`` never set, read for its default (a dict): the default's content,
    changed in place, is compared like a held dict's (probe 43a)."""

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * CONF.get()["k"]

    try:
        like_eager_then_retraced(ptj.jit(step), step, _set(CONF.get(), "k", 5.0))
    finally:
        CONF.get()["k"] = 2.0


SINGLE: dict[Any, Any] = {}


@pytest.mark.parametrize(("key", "other"), [(2, 2.0), (1, True), (0.0, -0.0)],
                         ids=["int-float", "int-bool", "zero-sign"])  # fmt: skip
def test_a_dict_of_one_entry_re_keyed_by_an_equal_key_retraces(key: Any, other: Any) -> None:
    """``{2: f}`` re-keyed ``{2.0: f}``: the entry is found under the old key, but a loop
    over the keys sees another type or sign (probe 43c). Dicts of two keys or more compared
    their keys already."""
    entry = _Settings()
    SINGLE.clear()
    SINGLE[key] = entry

    def step(x: torch.Tensor) -> torch.Tensor:
        (k,) = SINGLE
        return x * (2.0 if type(k) is float else 3.0) * np.copysign(1.0, k)

    def change() -> None:
        SINGLE.clear()
        SINGLE[other] = entry

    like_eager_then_retraced(ptj.jit(step), step, change)


def test_a_retrace_for_the_environment_names_no_values(monkeypatch: Any, caplog: Any) -> None:
    """The environment may hold secrets: its retrace is logged as ``changed``."""
    import logging

    monkeypatch.setenv("PHI_TORCH_JIT_TEST_SECRET", "hunter2")

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * len(os.environ["PHI_TORCH_JIT_TEST_SECRET"])

    jitted = ptj.jit(step)
    x = torch.ones(2)
    jitted(x)
    monkeypatch.setenv("PHI_TORCH_JIT_TEST_SECRET", "swordfish")
    with caplog.at_level(logging.INFO, logger="phi_torch_jit"):
        torch.testing.assert_close(jitted(x), step(x))
    assert "the environment (os.environ)" in caplog.text and "changed" in caplog.text
    assert "hunter2" not in caplog.text and "swordfish" not in caplog.text
    assert "hunter2" not in jitted.explain()


class _Factory:
    """A callable object making a ``defaultdict``'s missing entries."""

    def __init__(self) -> None:
        self.k = 2.0

    def __call__(self) -> float:
        return self.k


@pytest.mark.parametrize("how", ["factory called", "factory replaced"])
def test_a_defaultdicts_factory_is_guarded(how: str) -> None:
    """A ``defaultdict`` was compared by its entries, which equality compares, not by what
    makes the missing ones: a callable object as ``default_factory`` changed (or replaced) went
    unseen on every engine (probe 53a)."""
    table = collections.defaultdict(_Factory())

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * table.default_factory()

    def change() -> None:
        if how == "factory called":
            table.default_factory.k = 3.0
        else:
            table.default_factory = lambda: 5.0

    like_eager_then_retraced(ptj.jit(step), step, change)
