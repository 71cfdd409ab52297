"""Stage 1 (reads), ``_reads/_imported``: an object of a class of yours registered in
``sys.modules`` as a module (``sys.modules[NAME] = Config()``) is walked like an object the
step reads, however the step reaches it: ``sys.modules[NAME]``, ``importlib.import_module``
or ``__import__`` by a name held in a global, or by a name computed at run time (the record
pass notes it). Probe 53a found each silently wrong on every engine: its attributes changed,
or another object registered under the name, and the program kept the first."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator

import pytest
import torch
from helpers import like_eager_then_retraced

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines

_NAME = "phi_torch_jit_test_settings_object"
_PREFIX = "phi_torch_jit_test_"


class _Settings:
    def __init__(self, k: float = 2.0) -> None:
        self.k = k


@pytest.fixture
def registered() -> Iterator[None]:
    sys.modules[_NAME] = _Settings()  # type: ignore[assignment]
    yield
    sys.modules.pop(_NAME, None)


def _by_subscript(x: torch.Tensor) -> torch.Tensor:
    return x * sys.modules[_NAME].k  # type: ignore[attr-defined]


def _by_import_module(x: torch.Tensor) -> torch.Tensor:
    return x * importlib.import_module(_NAME).k  # type: ignore[attr-defined]


def _by_dunder_import(x: torch.Tensor) -> torch.Tensor:
    return x * __import__(_NAME).k  # type: ignore[attr-defined]


def _by_computed_name(x: torch.Tensor) -> torch.Tensor:
    return x * importlib.import_module(_PREFIX + "settings_object").k  # type: ignore[attr-defined]


_STEPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sys.modules[NAME]": _by_subscript,
    "import_module(NAME)": _by_import_module,
    "__import__(NAME)": _by_dunder_import,
    "import_module(computed)": _by_computed_name,
}


def _set_k() -> None:
    sys.modules[_NAME].k = 3.0  # type: ignore[attr-defined]


def _register_another() -> None:
    sys.modules[_NAME] = _Settings(5.0)  # type: ignore[assignment]


@pytest.mark.usefixtures("registered")
@pytest.mark.parametrize("change", [_set_k, _register_another], ids=["attribute", "replaced"])
@pytest.mark.parametrize("how", list(_STEPS))
def test_an_object_registered_as_a_module_is_guarded(how: str, change: Callable[[], None]) -> None:
    step = _STEPS[how]
    like_eager_then_retraced(ptj.jit(step), step, change)
