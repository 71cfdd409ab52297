"""Stage 5 (serving): a jitted function measures itself and serves the faster path.

Two rules, NOTE [never slower than eager] in docs/design.md:

* **Per specialization** (:class:`Meter`): the first compiled calls after a warm-up are timed
  (``SAMPLES`` of them, the clock read around each; nothing else runs), then ``SAMPLES`` calls
  run eagerly and are timed, for an honest comparison. A program found slower is measured
  again, ``SAMPLES`` calls of each path alternating (a burst of load then slows both), before
  it is dropped (:data:`TO_DROP` calls in all); the specialization then serves
  whichever path is faster (more than 10% slower compiled: eager), said in one log line and in
  ``explain()`` with the figures. After the decision a call pays one attribute test. A
  decision for eager code is not final: after :data:`REVISIT` eager calls (then twice as many
  each time it holds, up to :data:`MAX_REVISIT`) the paths are measured again, alternating; a
  program that was dropped because a burst of load fell on its samples is served again. While
  a background compile of ours runs (``busy``), the paths are sampled alternating from the
  first sample on, so the compile slows both alike and never decides against one. The
  record pass is no measure of eager's time: it was 44x eager's on a complex-valued step (a
  first call, with the recording's patches), so a program 1.8x slower than eager passed for
  fast when it was compared with it.
* **Per function** (:class:`HitRate`): a function whose calls keep missing (at least
  ``MISSES`` of the last ``WINDOW`` calls started a new specialization: shapes, static values
  or branches that never repeat) stops compiling; its calls run the Python function. So does
  a function whose cached specializations all run eagerly and served ``WINDOW`` calls in a row.

``jit(fallback="off")`` keeps every compiled program; ``engine="eager"`` forces eager code.
The decisions live on the jitted function and its specializations: ``clear_caches()`` drops
the specializations (and their per-specialization decisions) but not a function's
hit-rate decision. :data:`CLOCK` is read through this module so tests can use a fake clock.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "CLOCK",
    "FALLBACKS",
    "Meter",
    "HitRate",
    "SAMPLES",
    "SLOWER",
    "TO_DROP",
    "WINDOW",
    "MISSES",
    "REVISIT",
    "MAX_REVISIT",
]

CLOCK: Callable[[], float] = time.perf_counter
"""Seconds; replaced by tests."""
FALLBACKS = ("measure", "off")
"""``jit(fallback=...)``: ``"measure"`` (default) serves the faster path, ``"off"`` always the
compiled program."""
WARM_UP = 1
"""Compiled calls not timed (allocations, lazy initialization)."""
SAMPLES = 5
"""Timed calls per path."""
TO_DROP = WARM_UP + 4 * SAMPLES
"""Calls until a program measured slower than eager in two rounds is dropped."""
SLOWER = 1.1
"""Compiled must not be more than this times eager's step time."""
REVISIT = 64
"""Eager calls after which a decision for eager code is measured again (alternating)."""
MAX_REVISIT = 4096
"""The interval doubles each time eager wins again, up to this many calls: a program truly
slower than eager then costs ``SAMPLES`` slow calls in 4096."""
WINDOW = 24
"""Calls over which a function's miss rate is judged."""
MISSES = 12
"""Misses in the last ``WINDOW`` calls after which a function runs eagerly."""
SCANNED = 12
"""Calls of one signature, within twice as many calls of the function, that ran other
paths' programs first (value guards failed) after which the signature runs eagerly."""

Run = Callable[[list[torch.Tensor]], Any]


class Meter:
    """Times one specialization's compiled calls against eager's (see the module docstring).

    ``done`` is the only field a decided call reads: True once the compiled program won.
    """

    def __init__(
        self,
        eager: Run,
        eager_s: float,
        on_switch: Callable[[str], None],
        busy: Callable[[], bool] = lambda: False,
    ) -> None:
        self.done = False
        """Decided for the compiled program (calls go straight to it)."""
        self.eager_wins = False
        """Decided for eager code (calls run the Python function)."""
        self.eager = eager
        """Runs the function eagerly on the flat inputs."""
        self.record_s = eager_s
        """The record pass: an eager run, recording overhead included (shown, not compared:
        a first call can take many times eager's step)."""
        self.compiled_s: list[float] = []
        """Timed compiled calls."""
        self.eager_s: list[float] = []
        """Timed eager calls (only when the compiled ones looked slow)."""
        self._skipped = 0
        self._on_switch = on_switch
        self._stale = False
        """Another program serves the calls now: what was measured no longer holds."""
        self.first_round: tuple[float, float] | None = None
        """(compiled, eager) medians of the first round, when it found the program slower and
        a second round decides (:attr:`confirming`)."""
        self.restarts = 0
        """How often the measurement started afresh (:meth:`restart`)."""
        self.busy = busy
        """Whether a compile of ours runs beside the caller now (engine "auto"'s background
        thread): then samples alternate."""
        self.revisit_after = REVISIT
        """Eager calls until the next re-measurement of a decision for eager code."""
        self._eager_calls = 0
        self._revisiting = False
        self.revisits = 0
        """How often a decision for eager code was measured again."""

    @property
    def confirming(self) -> bool:
        """In the second round: compiled and eager calls alternate (5 compiled then 5 eager
        calls once measured a heat step's program, 8x faster than eager, at 1.1x eager's time:
        a burst of load on a shared machine had slowed the compiled samples only). A revisit
        of a decision for eager code is measured so from the start."""
        return self.first_round is not None or self._revisiting

    def restart(self) -> None:
        """Another program serves calls from now on (engine "auto" switched to its compiled
        tier, which may be slower than the fast tier measured): measure afresh. May be called
        from another thread; the next call on the caller's thread starts over."""
        self._stale = True
        self.done = False

    def serve(self, compiled: Run, tensors: list[torch.Tensor]) -> Any:
        """One call while undecided (or decided for eager): run and time a path."""
        if self._stale:
            self._stale = False
            self.restarts += 1
            self.eager_wins = False
            self._revisiting = False
            self.first_round = None
            self.compiled_s, self.eager_s, self._skipped = [], [], 0
        if self.eager_wins:
            self._eager_calls += 1
            if self._eager_calls < self.revisit_after:
                return self.eager(tensors)
            self._measure_again()
        if self._skipped < WARM_UP:
            self._skipped += 1
            return compiled(tensors)
        if self.confirming or self.busy():  # alternate: load slows samples of both paths
            timing_eager = len(self.eager_s) < len(self.compiled_s)
        else:
            timing_eager = len(self.compiled_s) >= SAMPLES
        start = _now(tensors)
        result = self.eager(tensors) if timing_eager else compiled(tensors)
        seconds = _now(tensors) - start
        if type(result).__name__ == "GuardFailure" or self._stale:  # not a step of this path
            return result
        (self.eager_s if timing_eager else self.compiled_s).append(seconds)
        self._decide()
        return result

    def _measure_again(self) -> None:
        """A decision for eager code is revisited: one alternating round decides anew."""
        self.revisits += 1
        self.eager_wins = False
        self._eager_calls = 0
        self.compiled_s, self.eager_s = [], []
        self._revisiting = True

    def _decide(self) -> None:
        if len(self.compiled_s) < SAMPLES:
            return
        compiled = statistics.median(self.compiled_s)
        if len(self.eager_s) < SAMPLES:
            return
        eager = statistics.median(self.eager_s)
        if compiled <= SLOWER * eager:
            self.done = True
            if self._revisiting:  # the earlier decision was wrong: said, with the figures
                self._revisiting = False
                self._on_switch(self.describe())
            return
        if self._revisiting:  # eager again: revisit later, less often
            self.revisit_after = min(2 * self.revisit_after, MAX_REVISIT)
            self.eager_wins = True
            return
        if not self.confirming:  # measure again, alternating, before dropping the program
            self.first_round = (compiled, eager)
            self.compiled_s, self.eager_s = [], []
            return
        self.eager_wins = True
        self._on_switch(self.describe())

    def describe(self) -> str:
        """The figures, for the log and ``explain()``."""
        parts = [f"record pass (eager + recording) {self.record_s * 1e3:.3g} ms"]
        if self.compiled_s:
            parts.append(f"compiled {statistics.median(self.compiled_s) * 1e3:.3g} ms")
        if self.eager_s:
            parts.append(f"eager {statistics.median(self.eager_s) * 1e3:.3g} ms")
        verdict = (
            f"serves eager code (compiled is slower by more than {round((SLOWER - 1) * 100)}%)"
            if self.eager_wins
            else "serves the compiled program"
            if self.done
            else "measuring"
        )
        again = (
            f" (measured afresh {self.restarts}x: another program took over)" * bool(self.restarts)
            + f" (revisited {self.revisits}x; next after {self.revisit_after} eager calls)"
            * bool(self.revisits and self.eager_wins)
            + f" (revisited {self.revisits}x)" * bool(self.revisits and not self.eager_wins)
        )
        if self.first_round is not None:
            first_compiled, first_eager = self.first_round
            parts.append(
                f"first round compiled {first_compiled * 1e3:.3g} ms, eager "
                f"{first_eager * 1e3:.3g} ms (then measured again, alternating)"
            )
        return f"step time, median of {SAMPLES}{again}: {', '.join(parts)}; {verdict}"


def _now(tensors: list[torch.Tensor]) -> float:
    """The clock, after the device finished queued work (CUDA runs asynchronously)."""
    if tensors and tensors[0].is_cuda:
        torch.cuda.synchronize(tensors[0].device)
    return CLOCK()


class HitRate:
    """Which of a function's recent calls missed the cache (see the module docstring)."""

    def __init__(self) -> None:
        self.calls = 0
        """Calls so far (counted on every call: one integer add)."""
        self._misses: deque[int] = deque(maxlen=MISSES)

    def missed(self) -> bool:
        """Note a miss of the current call; True if the function should now run eagerly."""
        self._misses.append(self.calls)
        return len(self._misses) == MISSES and self.calls - self._misses[0] < WINDOW
