"""Stage 5 (serving): a jitted function measures itself and serves the faster path.

Two rules, NOTE [never slower than eager] in docs/design.md:

* **Per specialization** (:class:`Meter`): after a warm-up call, calls are timed (the clock read
  around each, plus the backward that follows it, where one does: from the moment the autograd
  engine reaches the step's outputs to the end of that backward pass, so that a program with a
  fast forward and a slow compiled backward is not kept) in rounds where one call in
  :data:`EAGER_EVERY` runs eagerly and the others run the program, until :data:`SAMPLES` eager
  calls were timed (:data:`ROUND` calls), or earlier, after :data:`EARLY_SAMPLES`, where the
  program won by far (:data:`DECISIVE`: its mean call 3x faster than eager's fastest).
  Interleaved, a burst of load slows samples of both paths, and from its second call on the
  function serves its program on 4 of 5 calls while it measures (a meter that timed 5 eager
  calls in a row made a PhiFlow heat step's median over 12 steps eager's). A program found
  slower is measured a second round before it is dropped (:data:`TO_DROP` calls in all); the
  specialization then serves whichever path is faster (more than 10% slower compiled: eager),
  said in one log line and in ``explain()`` with the figures. After the decision a call pays one
  attribute test. A decision for eager code is not final: after :data:`REVISIT` eager calls
  (then twice as many each time it holds, up to :data:`MAX_REVISIT`) a round measures the paths
  again; a program dropped because a burst of load fell on both its rounds is served again. The
  record pass is no measure of eager's time: it was 44x eager's on a complex-valued step (a
  first call, with the recording's patches), so a program 1.8x slower than eager passed for fast
  when it was compared with it.
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
from dataclasses import dataclass
from typing import Any

import torch

from ._compat import QUEUE_CALLBACK

__all__ = [
    "CLOCK",
    "FALLBACKS",
    "Meter",
    "Measured",
    "A_PROGRAM",
    "HitRate",
    "SAMPLES",
    "trimmed_mean",
    "SLOWER",
    "EARLY_SAMPLES",
    "DECISIVE",
    "TO_DROP",
    "WINDOW",
    "MISSES",
    "REVISIT",
    "MAX_REVISIT",
    "EAGER_EVERY",
    "ROUND",
]

CLOCK: Callable[[], float] = time.perf_counter
"""Seconds; replaced by tests."""
FALLBACKS = ("measure", "off")
"""``jit(fallback=...)``: ``"measure"`` (default) serves the faster path, ``"off"`` always the
compiled program."""
WARM_UP = 1
"""Compiled calls not timed (allocations, lazy initialization)."""
SAMPLES = 5
"""Timed eager calls per round."""
EAGER_EVERY = 5
"""One timed call in this many runs eagerly; the others run the program."""
ROUND = SAMPLES * EAGER_EVERY
"""Timed calls per round (``SAMPLES`` eager, the rest compiled)."""
TO_DROP = WARM_UP + 2 * ROUND
"""Calls until a program measured slower than eager in two rounds is dropped."""
EARLY_SAMPLES = 2
"""Timed eager calls after which a decisive win ends a round early (:data:`DECISIVE`)."""
DECISIVE = 3.0
"""A round ends early for the program when its timed calls, on average, are this many times
faster than eager's fastest: a PhiFlow gradient step compiled to 13 ms against eager's 480 ms
paid five eager samples, 2.4 s, to learn what two showed. The mean, not the slowest call: one
call slowed by the background compile beside it (a PhiFlow heat step's program took 2-3 ms,
one call 11.5 ms, eager 29-59 ms) made the round run its five eager samples; a program slow
one call in a few pays that in its mean as the user does."""
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

Run = Callable[[list[torch.Tensor]], Any]


def _guard_failed(result: Any) -> bool:
    return type(result).__name__ == "GuardFailure"


@dataclass(frozen=True)
class Measured:
    """What a :class:`Meter` times against eager code, and how its figures name it."""

    name: str = ""
    """How the figures name it ("": "compiled", or "uncompiled graph")."""
    by_mean: bool = False
    """Its samples are summed up by their mean (trimmed, :func:`trimmed_mean`), not their
    median: where its calls differ by design (a signature's paths, each call running one to
    several programs), the user pays the mean."""
    afresh: str = "another program took over"
    """Why the measurement starts afresh (:attr:`Meter.restarts`), for the figures."""
    not_a_step: Callable[[Any], bool] = _guard_failed
    """Whether a result is no step of it (a value guard failed: not timed)."""


A_PROGRAM = Measured()
"""A specialization's program (compiled, or its captured graph run uncompiled)."""


class Meter:
    """Times one specialization's compiled calls against eager's (see the module docstring).

    ``done`` is the only field a decided call reads: True once the compiled program won.
    """

    def __init__(
        self,
        eager: Run,
        eager_s: float | None,
        on_switch: Callable[[str], None],
        compiled: bool = True,
        measured: Measured = A_PROGRAM,
    ) -> None:
        self.compiled = compiled
        """Whether the program is a backend's compile (False: a captured graph run uncompiled,
        its backend having failed): said so in the figures, never called compiled."""
        self.measured = measured
        """What is timed against eager code, and how the figures name it."""
        self._typical: Callable[[list[float]], float] = (
            trimmed_mean if self.measured.by_mean else statistics.median
        )
        self.done = False
        """Decided for the compiled program (calls go straight to it)."""
        self.eager_wins = False
        """Decided for eager code (calls run the Python function, revisited now and then)."""
        self.eager = eager
        """Runs the function eagerly on the flat inputs."""
        self.record_s = eager_s
        """The record pass: an eager run, recording overhead included (shown, not compared:
        a first call can take many times eager's step); None: none is shown."""
        self.compiled_s: list[float] = []
        """Timed compiled calls of the current round."""
        self.eager_s: list[float] = []
        """Timed eager calls of the current round."""
        self._skipped = 0
        self._timed = 0
        self._on_switch = on_switch
        self._stale = False
        """Another program serves the calls now: what was measured no longer holds."""
        self.first_round: tuple[float, float] | None = None
        """(compiled, eager) medians of the first round, when it found the program slower and
        a second round decides (:attr:`confirming`)."""
        self.restarts = 0
        """How often the measurement started afresh (:meth:`restart`)."""
        self.revisit_after = REVISIT
        """Eager calls until the next re-measurement of a decision for eager code."""
        self.revisits = 0
        """How often a decision for eager code was measured again."""
        self._eager_calls = 0
        self._revisiting = False
        self._decide_next = False
        """The round is complete but its last sample's backward runs after this call: decide
        at the next call."""
        self._known_eager: list[float] = []
        """Eager's samples from before a restart, while the new program's first calls are
        timed against them (:meth:`_decide_against_known_eager`)."""

    @property
    def confirming(self) -> bool:
        """In a second round: the first found the program slower (a burst of load on a
        shared machine once slowed a heat step's program, 8x faster than eager, to 1.1x
        eager's time), or a decision for eager code is revisited."""
        return self.first_round is not None or self._revisiting

    def restart(self) -> None:
        """Another program serves calls from now on (engine "auto" switched to its compiled
        tier, which may be slower than the fast tier measured): measure afresh. May be called
        from another thread; the next call on the caller's thread starts over."""
        self._stale = True
        self.done = False
        self.compiled = True

    def serve(self, compiled: Run, tensors: list[torch.Tensor]) -> Any:
        """One call while undecided (or decided for eager): run and time a path."""
        if self._stale:
            self._stale = False
            self.restarts += 1
            known = self._known_eager or (
                self.eager_s if len(self.eager_s) >= EARLY_SAMPLES else []
            )
            self.eager_wins = self._revisiting = False
            self.first_round = None
            self._new_round()
            self._skipped = 0
            self._known_eager = known
        if self.eager_wins:
            self._eager_calls += 1
            if self._eager_calls < self.revisit_after:
                return self.eager(tensors)
            self._measure_again()
        if self._skipped < WARM_UP:
            self._skipped += 1
            return compiled(tensors)
        if self._decide_next:  # the last sample's backward had its chance to be timed
            self._decide_next = False
            self._decide()
            if self.done:
                return compiled(tensors)
            if self.eager_wins:
                return self.eager(tensors)
        if self._known_eager and len(self.compiled_s) >= EAGER_EVERY - 1:
            self._decide_against_known_eager()
            if self.done:
                return compiled(tensors)
        timing_eager = (self._timed + 1) % EAGER_EVERY == 0
        start = _now(tensors)
        result = self.eager(tensors) if timing_eager else compiled(tensors)
        seconds = _now(tensors) - start
        if self.measured.not_a_step(result) or self._stale:  # not a step of this path
            return result
        self._timed += 1
        samples = self.eager_s if timing_eager else self.compiled_s
        samples.append(seconds)
        backward = _time_backward(result, samples, len(samples) - 1)
        if len(self.eager_s) >= SAMPLES or (timing_eager and len(self.eager_s) >= EARLY_SAMPLES):
            if backward:
                self._decide_next = True
            else:
                self._decide()
        return result

    def _decide_against_known_eager(self) -> None:
        """After a restart, the round's first ``EAGER_EVERY - 1`` timed calls (backwards
        included) run the new program, as in any round; the new program then serves where it
        wins by :data:`DECISIVE` against eager's samples from before the restart (a PhiFlow
        step paid two more eager steps of 240 ms after each switch, to learn what was known).
        Otherwise the round goes on as any program's, its next call eager's."""
        self.eager_s, self._known_eager = self._known_eager, []
        if self._decisive():
            self.done = True
        else:
            self.eager_s = []

    def _new_round(self) -> None:
        self.compiled_s, self.eager_s, self._timed = [], [], 0
        self._decide_next = False

    def _measure_again(self) -> None:
        """A decision for eager code is revisited: one round decides anew."""
        self.revisits += 1
        self.eager_wins = False
        self._eager_calls = 0
        self._revisiting = True
        self._new_round()

    def _decisive(self) -> bool:
        """The program's mean timed call :data:`DECISIVE` times faster than eager's fastest,
        after at least :data:`EARLY_SAMPLES` eager calls."""
        return (
            len(self.eager_s) >= EARLY_SAMPLES
            and bool(self.compiled_s)
            and statistics.fmean(self.compiled_s) * DECISIVE <= min(self.eager_s)
        )

    def _decide(self) -> None:
        early = len(self.eager_s) < SAMPLES
        if early and not self._decisive():  # the round goes on
            return
        compiled = self._typical(self.compiled_s)
        eager = statistics.median(self.eager_s)
        if early or compiled <= SLOWER * eager:
            self.done = True
            if self._revisiting:  # the earlier decision was wrong: said, with the figures
                self._revisiting = False
                self._on_switch(self.describe())
            return
        if self._revisiting:  # eager again: revisit later, less often
            self.revisit_after = min(2 * self.revisit_after, MAX_REVISIT)
            self.eager_wins = True
            return
        if not self.confirming:  # measure again before dropping the program
            self.first_round = (compiled, eager)
            self._new_round()
            return
        self.eager_wins = True
        self._on_switch(self.describe())

    def describe(self) -> str:
        """The figures, for the log and ``explain()``."""
        parts = []
        if self.record_s is not None:
            parts.append(f"record pass (eager + recording) {self.record_s * 1e3:.3g} ms")
        named = self.measured.name
        program = named or ("compiled" if self.compiled else "uncompiled graph")
        served = named or ("compiled program" if self.compiled else "uncompiled graph")
        if self.compiled_s:
            parts.append(f"{program} {self._typical(self.compiled_s) * 1e3:.3g} ms")
        if self.eager_s:
            parts.append(f"eager {statistics.median(self.eager_s) * 1e3:.3g} ms")
        verdict = (
            f"serves eager code ({program}: slower by more than {round((SLOWER - 1) * 100)}%)"
            if self.eager_wins
            else f"serves the {served}"
            if self.done
            else "measuring"
        )
        notes = []
        if self.restarts:
            notes.append(f"measured afresh {self.restarts}x: {self.measured.afresh}")
        if self.revisits:
            notes.append(f"revisited {self.revisits}x")
        if self.revisits and self.eager_wins:
            notes.append(f"next after {self.revisit_after} eager calls")
        again = f" ({'; '.join(notes)})" if notes else ""
        if self.first_round is not None:
            first_compiled, first_eager = self.first_round
            parts.append(
                f"first round {program} {first_compiled * 1e3:.3g} ms, eager "
                f"{first_eager * 1e3:.3g} ms (then measured again)"
            )
        if not parts:
            parts.append("nothing timed yet")
        typical = "means and medians" if self.measured.by_mean else "medians"
        return f"step time, {typical}{again}: {', '.join(parts)}; {verdict}"


TRIMMED = 0.1
"""The share of samples left out at each end by :func:`trimmed_mean`."""


def trimmed_mean(samples: list[float]) -> float:
    """The mean without the :data:`TRIMMED` largest and smallest samples: a compile inside a
    timed call (engine "compile" compiles a path once it is taken again) or a pause of the
    process made a signature's first round 7.8 ms on average, its second 0.21 ms."""
    cut = int(len(samples) * TRIMMED)
    ordered = sorted(samples)
    return statistics.fmean(ordered[cut : len(ordered) - cut] or ordered)


def _time_backward(result: Any, samples: list[float], index: int) -> bool:
    """Add the backward of ``result`` to ``samples[index]`` when it runs: from the moment the
    autograd engine reaches the step's outputs to the end of that backward pass (which, in a
    training loop, ends at the parameters and inputs of the step). Both paths are timed so,
    so a program whose compiled backward is slow is not kept for its fast forward. False
    where no backward can follow (no output needs a gradient)."""
    if not torch.is_grad_enabled():
        return False
    nodes = {t.grad_fn for t in _tensors(result, 3) if t.grad_fn is not None}
    if not nodes:
        return False
    started: list[float] = []

    def finished() -> None:
        samples[index] += CLOCK() - started[0]

    def reached(grad_outputs: Any) -> None:
        if not started:
            started.append(CLOCK())
            QUEUE_CALLBACK.find()(finished)

    for node in nodes:
        node.register_prehook(reached)
    return True


def _tensors(value: Any, depth: int) -> list[torch.Tensor]:
    """The tensors in a step's result (tuples, lists, dict values; a few levels)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth == 0:
        return []
    items = value.values() if isinstance(value, dict) else value
    if not isinstance(value, (tuple, list, dict)):
        return []
    return [t for item in items for t in _tensors(item, depth - 1)]


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
