"""Names the step looks for and does not find when traced (_reads._python, _modules_seen): a
global read under ``try/except NameError``, through ``globals().get`` or ``in globals()``, a
name set on ``builtins`` and shadowed later by a module global, and an attribute of the user's
module read with a default (``getattr(settings, "K", 1.0)``, ``vars(settings).get``,
``sys.modules[__name__].__dict__.get``). Defining one later must retrace: the program baked
in the fallback. Found by a probe of 181 state-change programs (7 of its 11 silent-wrong)."""

from __future__ import annotations

import builtins
import functools
import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import like_eager_then_retraced

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines


@pytest.fixture
def module_globals() -> Iterator[dict[str, Any]]:
    """This module's globals; names the tests define there are removed afterwards."""
    names = set(globals())
    yield globals()
    for name in set(globals()) - names:
        del globals()[name]


def _boosted(x: torch.Tensor) -> torch.Tensor:
    try:
        return x * PTJ_BOOST  # type: ignore[name-defined]  # (defined later, or never)
    except NameError:
        return x


def _extra(x: torch.Tensor) -> torch.Tensor:
    return x + globals().get("PTJ_EXTRA", 0.0)


def _debug_scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 3.0 if "PTJ_DEBUG" in globals() else x


@pytest.mark.parametrize("step", [_boosted, _extra, _debug_scaled], ids=lambda f: f.__name__)
def test_a_global_defined_after_the_trace_retraces(
    step: Callable[..., Any], module_globals: dict[str, Any]
) -> None:
    name = {_boosted: "PTJ_BOOST", _extra: "PTJ_EXTRA", _debug_scaled: "PTJ_DEBUG"}[step]
    like_eager_then_retraced(ptj.jit(step), step, lambda: module_globals.update({name: 5.0}))


def test_other_globals_defined_later_do_not_retrace(module_globals: dict[str, Any]) -> None:
    jitted = ptj.jit(_boosted)
    like_eager_then_retraced(jitted, _boosted, lambda: module_globals.update(PTJ_OTHER=1.0), 1)


def _helper(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x * scale + globals().get("PTJ_BIAS", 0.0)


def test_a_lookup_by_a_helper_behind_a_partial_is_guarded(module_globals: dict[str, Any]) -> None:
    helper = functools.partial(_helper, scale=2.0)

    def step(x: torch.Tensor) -> torch.Tensor:
        return helper(x) - 1.0

    like_eager_then_retraced(ptj.jit(step), step, lambda: module_globals.update(PTJ_BIAS=4.0))


def _gained(x: torch.Tensor) -> torch.Tensor:
    return x * PTJ_GAIN  # type: ignore[name-defined]  # noqa: F821 (set on builtins)


def test_a_name_on_builtins_shadowed_later_by_a_global_retraces(
    module_globals: dict[str, Any],
) -> None:
    builtins.PTJ_GAIN = 1.0  # type: ignore[attr-defined]
    try:
        jitted = ptj.jit(_gained)
        like_eager_then_retraced(jitted, _gained, lambda: module_globals.update(PTJ_GAIN=7.0))
    finally:
        del builtins.PTJ_GAIN  # type: ignore[attr-defined]


def test_a_name_defined_later_on_builtins_retraces() -> None:
    jitted = ptj.jit(_boosted)
    try:
        like_eager_then_retraced(jitted, _boosted, lambda: setattr(builtins, "PTJ_BOOST", 3.0))
    finally:
        del builtins.PTJ_BOOST  # type: ignore[attr-defined]


_READS = {
    "getattr": "def step(x):\n    return x * settings.GRAVITY * getattr(settings, 'SCALE', 1.0)\n",
    "vars": "def step(x):\n    return x * vars(settings).get('SCALE', 1.0)\n",
    "own dict": (
        "import sys\n"
        "SCALE_OF = 'SCALE'\n"
        "def step(x):\n    return x * sys.modules[__name__].__dict__.get('SCALE', 1.0)\n"
    ),
}


@pytest.mark.parametrize("read", list(_READS))
def test_an_attribute_of_the_users_module_read_with_a_default_is_guarded(
    read: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The module and the step live in files of the user's (a temporary folder)."""
    name = f"ptj_undefined_{read.replace(' ', '_')}"
    (tmp_path / "ptj_settings_mod.py").write_text("GRAVITY = 9.81\n")
    (tmp_path / f"{name}.py").write_text("import ptj_settings_mod as settings\n" + _READS[read])
    monkeypatch.syspath_prepend(str(tmp_path))
    for stale in ("ptj_settings_mod", name):
        sys.modules.pop(stale, None)
    importlib.invalidate_caches()
    module = importlib.import_module(name)
    owner = module if read == "own dict" else sys.modules["ptj_settings_mod"]
    try:
        define = functools.partial(setattr, owner, "SCALE", 4.0)
        like_eager_then_retraced(ptj.jit(module.step), module.step, define)
    finally:
        for stale in ("ptj_settings_mod", name):
            sys.modules.pop(stale, None)


def _boost_of(x: torch.Tensor) -> torch.Tensor:
    return x * getattr(_boost_of, "boost", 1.0)


def _flagged(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0 if hasattr(_flagged, "flag") else x


@pytest.mark.parametrize("helper", [_boost_of, _flagged], ids=lambda f: f.__name__)
def test_an_attribute_set_on_a_function_later_or_deleted_retraces(
    helper: Callable[..., Any],
) -> None:
    """``f.boost`` read with a default (or ``hasattr``) by a function the step calls: added
    after the trace, then deleted again (found by a probe)."""

    def step(x: torch.Tensor) -> torch.Tensor:
        return helper(x) + 1.0

    name = "boost" if helper is _boost_of else "flag"
    jitted = ptj.jit(step)
    try:
        like_eager_then_retraced(jitted, step, lambda: setattr(helper, name, 4.0))
        like_eager_then_retraced(jitted, step, lambda: delattr(helper, name), traces=2)
    finally:
        helper.__dict__.pop(name, None)
