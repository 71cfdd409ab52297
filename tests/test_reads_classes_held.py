"""Stage 1 (reads), classes of yours reached through values compared as a whole
(``_reads/_class_fields``): a class in a tuple (``T = (A, 1)``, an ``__init_subclass__``
registry kept as a tuple, an enum member's value), a class used as a dict key, the arguments
of a type alias (``Optional[A]`` read by ``typing.get_args``); and a class's hierarchy
(``C.__bases__`` reassigned: ``isinstance``, ``issubclass``, ``except``, a loop over
``__mro__``). Probe 51 found each silently wrong on every engine: the tuple was equal, so
nothing under it was compared."""

from __future__ import annotations

import enum
import typing
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import like_eager_then_retraced

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines


class _A:
    K = 2.0


class _Held(enum.Enum):
    X = (_A,)


PAIR = (_A, 1)
BY_CLASS = {_A: 1.0}
MAYBE = typing.Optional[_A]  # noqa: UP045 (typing's alias, as the probe wrote it)


def _scale_of(alias: Any) -> float:
    return float(typing.get_args(alias)[0].K)


STEPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "in a tuple": lambda x: x * PAIR[0].K,
    "a dict key": lambda x: x * sum(k.K * v for k, v in BY_CLASS.items()),
    "an enum's value": lambda x: x * _Held.X.value[0].K,
    "a type alias's argument": lambda x: x * _scale_of(MAYBE),
}


@pytest.mark.parametrize("how", list(STEPS))
def test_a_class_of_yours_held_in_a_value_compared_whole_is_walked(how: str) -> None:
    step = STEPS[how]
    try:
        like_eager_then_retraced(ptj.jit(step), step, lambda: setattr(_A, "K", 3.0))
    finally:
        _A.K = 2.0


class _Base:
    pass


class _Marker:
    pass


class _Caught(Exception):
    pass


class _Other(Exception):
    pass


class _Child(_Base):
    pass


class _Failure(_Other):
    pass


OBJ = _Child()


def _by_isinstance(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0 if isinstance(OBJ, _Marker) else x


def _by_issubclass(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0 if issubclass(_Child, _Marker) else x


def _by_mro(x: torch.Tensor) -> torch.Tensor:
    return x * len(type(OBJ).__mro__)


def _by_except(x: torch.Tensor) -> torch.Tensor:
    try:
        raise _Failure
    except _Caught:
        return x * 2.0
    except Exception:
        return x


@pytest.mark.parametrize("step", [_by_isinstance, _by_issubclass, _by_mro, _by_except],
                         ids=["isinstance", "issubclass", "mro", "except"])  # fmt: skip
def test_a_class_hierarchy_changed_by_its_bases_retraces(step: Any) -> None:
    def change() -> None:
        _Child.__bases__ = (_Base, _Marker) if step is not _by_except else (_Base,)
        _Failure.__bases__ = (_Caught,)

    try:
        like_eager_then_retraced(ptj.jit(step), step, change)
    finally:
        _Child.__bases__ = (_Base,)
        _Failure.__bases__ = (_Other,)
