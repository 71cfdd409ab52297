"""Draws a compiled program would repeat, however the step reaches them (_reads._kinds,
_unguardable): a random function imported by name or held in a container, a method bound to
a generator object, a ``SystemRandom``, a clock imported by name, entropy through the standard
library (``secrets``, ``uuid``), a library's draw from the global generators. Each was found
silently wrong by a probe: the record pass's patches see only calls through the module's
attribute, so the first call's draw was baked and repeated."""

from __future__ import annotations

import datetime
import random
import secrets
import sys
import textwrap
import time
import uuid
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from random import random as imported_random
from time import perf_counter
from typing import Any

import numpy as np
import pytest
import torch

import phi_torch_jit as ptj
from phi_torch_jit._reads._kinds import draws
from phi_torch_jit._reads._records import Kind

pytestmark = [pytest.mark.all_engines, pytest.mark.usefixtures("no_compile_left_running")]

HELD = {"draw": random.random}
BOUND = random.Random(0).random
SYSTEM = random.SystemRandom()
LEGACY = np.random.RandomState(0)
GENERATOR = np.random.default_rng(0)
NORMAL = partial(GENERATOR.normal, 0.0)


def _values(step: Callable[[torch.Tensor], torch.Tensor], calls: int = 4) -> list[float]:
    random.seed(7)
    np.random.seed(7)
    return [float(step(torch.ones(1))) for _ in range(calls)]


STEPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "imported by name": lambda x: x * imported_random(),
    "held in a dict": lambda x: x * HELD["draw"](),
    "bound to a Random": lambda x: x * BOUND(),
    "a NumPy RandomState": lambda x: x * float(LEGACY.rand()),
    "a partial of a Generator's method": lambda x: x * float(NORMAL()),
}


@pytest.mark.parametrize("name", list(STEPS))
def test_a_generator_read_however_it_is_named_runs_eagerly_warned(name: str) -> None:
    step = STEPS[name]
    jitted = ptj.jit(step)
    with pytest.warns(ptj.JitWarning, match="random generator or a clock"):
        got = _values(jitted)
    assert len(set(got)) == len(got)  # a new draw on every call, none repeated
    assert jitted.num_traces == 1


def test_the_same_draws_as_eager_from_a_seeded_generator() -> None:
    """Eager, warned: the seeded sequence is eager's, one draw per call (not two: the trace
    pass does not run)."""
    step = STEPS["imported by name"]
    with pytest.warns(ptj.JitWarning):
        got = _values(ptj.jit(step))
    assert got == _values(step)


def test_a_clock_imported_by_name_runs_eagerly_warned() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return x * (perf_counter() % 1.0)

    jitted = ptj.jit(step)
    with pytest.warns(ptj.JitWarning, match="global perf_counter"):
        jitted(torch.ones(1))


@pytest.mark.parametrize(
    "draw",
    [
        lambda: SYSTEM.random(),
        lambda: secrets.randbelow(1000) / 1000,
        lambda: uuid.uuid4().int % 1000 / 1000,
    ],
    ids=["SystemRandom", "secrets", "uuid4"],
)
def test_entropy_reached_through_the_standard_library_runs_eagerly_warned(
    draw: Callable[[], float],
) -> None:
    """``os.urandom`` called by ``secrets``, ``uuid`` or ``SystemRandom`` for the user's line:
    the standard library's frames are looked past to the user's."""
    jitted = ptj.jit(lambda x: x * draw())
    with pytest.warns(ptj.JitWarning, match="os.urandom"):
        got = [float(jitted(torch.ones(1))) for _ in range(4)]
    assert len(set(got)) > 1


@pytest.fixture
def library(tmp_path: Path, monkeypatch: Any) -> Any:
    """An installed library (its folder is named site-packages) that bound ``random`` and
    NumPy's ``rand`` at import, before any patch of ours, and names things with ``uuid4``."""
    folder = tmp_path / "site-packages"
    folder.mkdir()
    (folder / "_drawing_library.py").write_text(
        textwrap.dedent(
            """
            import uuid
            from random import random as _draw
            from numpy.random import rand as _rand

            def draw():
                return _draw()

            def draw_numpy():
                return float(_rand())

            def name():
                return str(uuid.uuid4())
            """
        )
    )
    monkeypatch.syspath_prepend(str(folder))
    yield __import__("_drawing_library")
    sys.modules.pop("_drawing_library", None)


def test_a_librarys_draw_from_the_global_generators_is_noticed(library: Any) -> None:
    """Seen by the global generators' states before and after the record pass."""
    for draw in (library.draw, library.draw_numpy):
        jitted = ptj.jit(lambda x, draw=draw: x * draw())
        with pytest.warns(ptj.JitWarning, match="global generator"):
            got = _values(jitted)
        assert len(set(got)) == len(got)


def test_a_library_naming_things_with_uuid_is_not_taken_for_a_draw(library: Any) -> None:
    """A package's own ``uuid4`` (PhiML names its solves so) is not the step's draw: only a
    user's line reached through the standard library counts."""

    def step(x: torch.Tensor) -> torch.Tensor:
        library.name()
        return x * 2

    jitted = ptj.jit(step)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for _ in range(3):
            torch.testing.assert_close(jitted(torch.ones(1)), torch.full((1,), 2.0))
    assert jitted.num_traces == 1
    assert "runs eagerly" not in jitted.explain()


def test_reading_the_seed_runs_eagerly_warned() -> None:
    jitted = ptj.jit(lambda x: x + torch.initial_seed() % 7)
    with pytest.warns(ptj.JitWarning, match="initial_seed"):
        for seed in (1, 2, 3):
            torch.manual_seed(seed)
            assert float(jitted(torch.zeros(1))) == seed % 7


def test_reading_numpys_global_state_runs_eagerly_warned() -> None:
    """Probe 41c: ``np.random.get_state()`` read in the step was baked in (the position of
    NumPy's global generator, moved by a draw outside the step); Python's
    ``random.getstate()`` and torch's ``get_rng_state()`` ran eagerly already."""
    step = lambda x: x * float(np.random.get_state()[2])  # noqa: E731
    jitted = ptj.jit(step)
    np.random.seed(0)
    with pytest.warns(ptj.JitWarning, match="numpy.random.get_state"):
        for _ in range(3):
            torch.testing.assert_close(jitted(torch.ones(1)), step(torch.ones(1)))
            np.random.random()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (random.random, True),
        (random.Random(1), True),
        (SYSTEM.getrandbits, True),
        (np.random.rand, True),
        (GENERATOR, True),
        (GENERATOR.bit_generator, True),
        (perf_counter, True),
        (torch.tanh, False),
        (len, False),
        ({}.get, False),
        (Kind, False),
    ],
)
def test_what_counts_as_a_draw(value: Any, expected: bool) -> None:
    assert draws(value) is expected


@pytest.mark.parametrize(
    "read",
    [
        lambda: time.process_time() % 1.0,
        lambda: datetime.datetime.now().microsecond / 1e6,
        lambda: time.clock_gettime(time.CLOCK_MONOTONIC) % 1.0,
        lambda: uuid.uuid1().time % 1000 / 1000,
        lambda: float(np.random.rand()),
    ],
    ids=["time.process_time", "datetime.now", "time.clock_gettime", "uuid1", "np.random.rand"],
)
def test_a_clock_called_through_its_module_runs_eagerly_warned(read: Callable[[], float]) -> None:
    """Clocks the record pass does not patch (C methods of ``datetime``, the rarer ``time``
    functions) are found by the walk: the names the code spells under a library's module or
    class (found by a probe: the first call's time was repeated)."""
    jitted = ptj.jit(lambda x: x * read())
    with pytest.warns(ptj.JitWarning, match="random generator or a clock"):
        jitted(torch.ones(1))


class _Seeded(torch.nn.Module):
    """Holds a generator; draws from it in ``forward`` only if asked to."""

    def __init__(self, draws_in_forward: bool) -> None:
        super().__init__()
        self.rng = np.random.default_rng(0)
        self.scale = float(self.rng.uniform(0.5, 1.0))  # drawn once, at construction
        self.draws_in_forward = draws_in_forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = float(self.rng.normal()) if self.draws_in_forward else 0.0
        return x * self.scale + noise


def test_a_generator_held_but_not_drawn_from_in_the_step_is_no_reason_to_run_eagerly() -> None:
    """A model seeding its initialization from ``self.rng`` had every forward run eagerly
    (found by a probe): a generator held is eager only if the record pass drew from it (its
    state changed)."""
    model = _Seeded(draws_in_forward=False)
    jitted = ptj.jit(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for _ in range(3):
            torch.testing.assert_close(jitted(torch.ones(2)), model(torch.ones(2)))
    assert "runs eagerly" not in jitted.explain()


def test_a_generator_held_and_drawn_from_in_the_step_runs_eagerly_warned() -> None:
    mine, theirs = _Seeded(draws_in_forward=True), _Seeded(draws_in_forward=True)
    jitted = ptj.jit(mine)
    with pytest.warns(ptj.JitWarning, match="random generator or a clock .*rng"):
        for _ in range(3):
            torch.testing.assert_close(jitted(torch.ones(2)), theirs(torch.ones(2)))


GENERATORS: dict[str, Callable[[], Any]] = {
    "random.Random": lambda: random.Random(3),
    "NumPy Generator": lambda: np.random.default_rng(3),
    "NumPy RandomState": lambda: np.random.RandomState(3),
}


def _scaled(x: torch.Tensor, rng: Any) -> torch.Tensor:
    return x * float(rng.random())


@pytest.mark.parametrize("kind", list(GENERATORS))
def test_a_generator_passed_as_an_argument_runs_eagerly_warned(kind: str) -> None:
    """``step(x, rng)`` raised SignatureError (no value hash): the step runs eagerly, warned,
    and draws what eager draws from the caller's generator, one draw per call."""
    mine, theirs = GENERATORS[kind](), GENERATORS[kind]()
    jitted = ptj.jit(_scaled)
    with pytest.warns(ptj.JitWarning, match="random generator or a clock"):
        got = [float(jitted(torch.ones(1), mine)) for _ in range(4)]
    assert got == [float(_scaled(torch.ones(1), theirs)) for _ in range(4)]
    assert len(set(got)) == 4


def test_a_torch_generator_passed_as_an_argument_runs_eagerly_warned() -> None:
    """``torch.rand(n, generator=gen)`` with ``gen`` passed: eager's draws, warned; a generator
    passed but not drawn from is no reason to run eagerly."""

    def noisy(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        return x + torch.rand(x.shape, generator=gen)

    mine, theirs = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    jitted = ptj.jit(noisy)
    with pytest.warns(ptj.JitWarning, match="torch.Generator"):
        for _ in range(3):
            torch.testing.assert_close(jitted(torch.ones(3), mine), noisy(torch.ones(3), theirs))

    def unused(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        return x * 2

    quiet = ptj.jit(unused)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for _ in range(3):
            torch.testing.assert_close(quiet(torch.ones(3), mine), torch.full((3,), 2.0))
    assert "runs eagerly" not in quiet.explain()
    assert quiet.num_traces == 1


def test_the_record_passes_wrappers_are_made_once_and_kept() -> None:
    """Dynamo notes the ids of NumPy's functions when it first meets one; where that was inside
    a record pass (``torch.cond`` in the step), it noted our wrappers of ``numpy.random``'s.
    Made anew per pass and freed after it, their ids went to the user's lambdas, which dynamo
    then refused as NumPy functions (an eager ``torch.cond`` raised
    UncapturedHigherOrderOpError now and then). The wrappers are made once and kept."""
    from phi_torch_jit._unguardable import _Watch

    original, seen = np.random.rand, []
    for _ in range(2):
        watch = _Watch()
        watch.install()
        try:
            seen.append(np.random.rand)
        finally:
            watch.remove()
    assert seen[0] is seen[1] and seen[0] is not original and np.random.rand is original
