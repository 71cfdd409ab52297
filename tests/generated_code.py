"""Classes and functions for tests/test_reads_generated_code.py, in a module of their own as
a user's project would have them: a dataclass whose generated ``__init__`` calls a factory
reading this module's globals, a metaclass whose ``__call__`` reads its own attribute, a
``singledispatchmethod``."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

GAIN = 2.0


@dataclasses.dataclass
class Made:
    coefficients: list[float] = dataclasses.field(default_factory=lambda: [GAIN])


class Meta(type):
    multiplier = 2.0

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        made = super().__call__(*args, **kwargs)
        made.m = Meta.multiplier
        return made


class ByMeta(metaclass=Meta):
    m: float


class Dispatching:
    @functools.singledispatchmethod
    def scale(self, v: Any) -> float:
        return 1.0

    @scale.register
    def _(self, v: int) -> float:
        return 20.0
