"""Stage 5 (serving): a signature served by several value-guarded programs measures what
trying them costs against eager code (NOTE [values that never repeat]).

Value guards make one specialization per path the Python took on tensor values; a call runs
the signature's programs newest first until one's guards hold
(:func:`._specialization.run_first_valid`), so a signature whose paths alternate pays for
the programs that ran in vain. Whether it still beats eager code is measured like one
program is (:class:`._meter.Meter`): once a signature has two or more paths, its calls, each
with whatever programs it ran in vain, are timed against eager calls interleaved with them
(backward included where one follows), their mean (what the user pays: calls differ by
design) against eager's median. Slower by more than ``SLOWER``: the signature's
calls run the Python function, measured again after ``REVISIT`` eager calls (then twice as
many each time eager wins again). A new path starts the measurement afresh. Nothing is
counted: an iteration whose exit varies among a few counts keeps its programs where they
are fast enough to pay for the ones that ran in vain, and drops them where they are not.
``jit(fallback="off")`` keeps the programs without measuring.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._meter import Measured, Meter
from ._specialization import Key, Miss, Scanned, Specialization, run_first_valid

__all__ = ["PathMeters"]

Run = Callable[[list[torch.Tensor]], Any]


def _missed(result: Any) -> bool:
    return isinstance(result, Miss)


PATHS = Measured(
    "programs of its paths, tried in turn", by_mean=True, afresh="a new path was compiled",
    not_a_step=_missed,
)  # fmt: skip
"""What a signature's meter times: the lookup, every program run in vain included."""


class PathMeters:
    """The meters of a jitted function's signatures that have several paths."""

    def __init__(self, eager_for: Callable[[Key], Run], on_switch: Callable[[str], None]) -> None:
        self._eager_for = eager_for
        self._on_switch = on_switch
        self._meters: dict[Key, tuple[Meter, int]] = {}
        """Per signature: its meter, and how many paths it measured."""

    def serve(self, key: Key, paths: Sequence[Specialization], tensors: list[torch.Tensor]) -> Any:
        """One call of ``key``, whose cached specializations are ``paths`` (two or more): the
        result, or a :class:`Miss` when no path's guards held (not timed)."""
        entry = self._meters.get(key)
        if entry is None or entry[1] != len(paths):  # a new path: measured afresh
            meter = Meter(self._eager_for(key), None, self._on_switch, measured=PATHS)
            if entry is not None:
                meter.restarts = entry[0].restarts + 1
            self._meters[key] = entry = (meter, len(paths))
        meter = entry[0]
        if meter.done:  # decided for the programs: nothing more to time
            return _first_valid(paths, tensors)
        return meter.serve(functools.partial(_first_valid, paths), tensors)

    def describe(self) -> list[tuple[Key, str]]:
        """Each measured signature with its figures (``explain()``)."""
        return [(key, meter.describe()) for key, (meter, _) in list(self._meters.items())]

    def forget(self, key: Key) -> None:
        """``key``'s paths were replaced (by one eager specialization)."""
        self._meters.pop(key, None)

    def clear(self) -> None:
        self._meters.clear()


def _first_valid(paths: Sequence[Specialization], tensors: list[torch.Tensor]) -> Any:
    """The first path whose guards hold serves the call (those run before it, in vain,
    count in its time); a :class:`Miss` if none does."""
    result = run_first_valid(paths, tensors)
    return result.result if type(result) is Scanned else result
