"""Classes whose instances a test passes as arguments keyed by value, and the module globals
their methods read (tests/test_reads_argument_classes.py). A module of its own, as a user's
project would have."""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

import torch

GAIN = 2.0


class Mode(enum.Enum):
    A = 1

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x * GAIN


@dataclasses.dataclass(frozen=True)
class Settings:
    a: float = 1.0
    SCALE = 1.0  # a class constant, not a field

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x * GAIN * self.a * self.SCALE


class Pair(NamedTuple):
    a: float

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x * GAIN * self.a


class Solver:
    K = 2.0

    @classmethod
    def apply(cls, x: torch.Tensor) -> torch.Tensor:
        return x * cls.K * GAIN
