"""The caches of ``functools.lru_cache`` and ``functools.cache`` functions the step calls
(_reads._cached_calls): a cleared cache and a cached result changed in place were baked
silently (a probe; the guard on what the cached function reads had passed, re-recorded at a
retrace whose record pass hit the stale entry). Their state is guarded as ``cache_info()``
tells it, and what the record pass saw them return like any read object; a step calling a
cached function on every call does not retrace."""

from __future__ import annotations

import functools
import types
from typing import Any

import pytest
import torch
from helpers import Counter, like_eager_then_retraced

import phi_torch_jit as ptj
from phi_torch_jit._reads._cached_calls import is_cache

pytestmark = pytest.mark.all_engines

CFG = types.SimpleNamespace(k=2.0)


@functools.lru_cache
def coefficient() -> float:
    return CFG.k * 2


@functools.cache
def table() -> list[float]:
    return [1.0, 2.0]


@functools.lru_cache(maxsize=8)
def row(n: int) -> list[float]:
    return [CFG.k * n, 1.0]


N = 3


class Scaled:
    @functools.lru_cache  # noqa: B019 (the object lives as long as the test's class)
    def factors(self) -> list[float]:
        return [CFG.k, 0.5]


SCALED = Scaled()


@pytest.fixture(autouse=True)
def fresh() -> Any:
    """Each test starts with empty caches and k = 2."""
    CFG.k = 2.0
    for cached in (coefficient, table, row, Scaled.factors):
        cached.cache_clear()
    yield
    CFG.k = 2.0


def test_a_cleared_cache_retraces() -> None:
    """``k`` changed: eager keeps the cached value, and so does the retrace (the guard on
    ``CFG.k`` retraced, and the record pass hit the cache); then ``cache_clear()``: eager
    computes anew from k = 3, which the traced program had not."""

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * coefficient()

    jitted = ptj.jit(step)
    like_eager_then_retraced(jitted, step, lambda: setattr(CFG, "k", 3.0))
    like_eager_then_retraced(jitted, step, coefficient.cache_clear, traces=3)


def test_a_cache_cleared_and_refilled_outside_the_step_retraces() -> None:
    """``cache_clear()`` resets the misses too: refilled by one call outside (from k = 3, the
    value the guard on ``CFG.k`` holds), as many misses and entries as when traced; the hits,
    lower than they were, tell."""

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * coefficient()

    def clear_and_refill() -> None:
        coefficient.cache_clear()
        coefficient()

    jitted = ptj.jit(step)
    like_eager_then_retraced(jitted, step, lambda: setattr(CFG, "k", 3.0))
    like_eager_then_retraced(jitted, step, clear_and_refill, traces=3)


def test_a_program_traced_before_a_clear_is_not_served_after_the_step_refilled_it() -> None:
    """k = 2, then k = 3 with ``cache_clear()``: the retrace's record and trace passes refill
    the cache (one miss, one hit, as the first program's had). Back at k = 2 the first
    program's guards held again (``CFG.k`` as then, the counts as then) and it served
    ``2 * 2`` where eager's cache hands out ``3 * 2`` (probe 38a)."""

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * coefficient()

    def clear_at_three() -> None:
        CFG.k = 3.0
        coefficient.cache_clear()

    jitted, x = ptj.jit(step), torch.ones(2)
    for change in (lambda: None, clear_at_three, lambda: setattr(CFG, "k", 2.0)):
        change()
        for _ in range(2):
            torch.testing.assert_close(jitted(x), step(x))
            jitted.wait_compiled()
    assert step(x)[0].item() == 6.0  # the premise: eager keeps the value cached at k = 3
    assert jitted.num_traces == 3


@functools.lru_cache
def total(t: torch.Tensor) -> torch.Tensor:
    return t.sum()


WEIGHTS = torch.tensor([1.0, 2.0])


def test_a_cached_function_called_with_a_tensor_runs_the_step_eagerly_warned() -> None:
    """``total(WEIGHTS)`` is keyed by the tensor object: eager keeps the first sum after
    ``WEIGHTS.add_(1)``; a compiled program (the trace's stand-in missed the cache and
    recorded the sum) computed it anew, and so did every compiled call (probe 38d)."""

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * total(WEIGHTS)

    total.cache_clear()
    saved, x = WEIGHTS.clone(), torch.ones(2)
    jitted = ptj.jit(step)
    try:
        with pytest.warns(ptj.JitWarning, match=r"total\(\) is cached and was called with a"):
            for _ in range(4):
                torch.testing.assert_close(jitted(x), step(x))
                jitted.wait_compiled()
                WEIGHTS.add_(1.0)
        assert step(x)[0].item() == 3.0  # the premise: eager keeps the first sum
    finally:
        WEIGHTS.copy_(saved)
        total.cache_clear()


def test_a_cached_result_changed_in_place_retraces() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return x * table()[0]

    def change() -> None:
        table()[0] = 5.0

    like_eager_then_retraced(ptj.jit(step), step, change)


def test_a_cached_function_with_an_argument_is_guarded() -> None:
    """``row(N)``, an int key: its result changed in place, then the cache cleared after the
    state it reads changed."""

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * row(N)[0] + row(N)[1]

    def change() -> None:
        row(N)[1] = 4.0

    jitted = ptj.jit(step)
    like_eager_then_retraced(jitted, step, change)

    def cleared() -> None:
        CFG.k = 7.0
        row.cache_clear()

    like_eager_then_retraced(jitted, step, cleared, traces=3)


def test_a_cached_function_called_with_the_steps_int_argument() -> None:
    """Each ``n`` is a specialization; the entry the second adds (a miss) retraces the first
    once, after which each holds; a result changed in place retraces only the one that read
    it."""

    def step(x: torch.Tensor, n: int) -> torch.Tensor:
        return x * row(n)[0]

    jitted, x = ptj.jit(step), torch.ones(3)
    for n in (1, 2, 1, 2, 1, 2):
        torch.testing.assert_close(jitted(x, n), step(x, n))
    assert jitted.num_traces == 3, jitted.explain()
    row(2)[0] = 9.0
    for n in (1, 2, 2):
        torch.testing.assert_close(jitted(x, n), step(x, n))
    assert jitted.num_traces == 4, jitted.explain()


def test_a_cached_method_is_guarded() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return x * SCALED.factors()[0] + SCALED.factors()[1]

    def change() -> None:
        SCALED.factors()[1] = 3.0

    jitted = ptj.jit(step)
    like_eager_then_retraced(jitted, step, change)

    def cleared() -> None:
        CFG.k = 4.0
        Scaled.factors.cache_clear()

    like_eager_then_retraced(jitted, step, cleared, traces=3)


def test_a_cached_function_in_a_closure_is_guarded() -> None:
    @functools.cache
    def weights() -> dict[str, float]:
        return {"w": CFG.k}

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * weights()["w"]

    def change() -> None:
        weights()["w"] = 6.0

    jitted = ptj.jit(step)
    like_eager_then_retraced(jitted, step, change)
    like_eager_then_retraced(jitted, step, weights.cache_clear, traces=3)


OPS = [table]
HOLDER = types.SimpleNamespace(rows=row)


def test_a_cached_function_held_in_a_list_or_by_an_object_is_guarded() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return x * OPS[0]()[0] + HOLDER.rows(N)[1]

    def change() -> None:
        table()[0] = 3.0

    jitted = ptj.jit(step)
    like_eager_then_retraced(jitted, step, change)
    like_eager_then_retraced(jitted, step, lambda: row(N).append(0.0), traces=3)

    def cleared() -> None:
        CFG.k = 4.0
        row.cache_clear()

    like_eager_then_retraced(jitted, step, cleared, traces=4)


def test_a_step_calling_a_cached_function_on_every_call_traces_once() -> None:
    """Hits grow on the calls served eagerly (the record pass, the meter's eager samples);
    compiled calls do not call it, and the misses stay."""
    runs = Counter()

    def step(x: torch.Tensor) -> torch.Tensor:
        runs.forward += 1
        return x * coefficient() + table()[1] + row(N)[0] + SCALED.factors()[1]

    jitted, x = ptj.jit(step), torch.ones(3)
    for _ in range(10):
        torch.testing.assert_close(jitted(x), step(x))
    jitted.wait_compiled()
    for _ in range(20):
        jitted(x)
    assert jitted.num_traces == 1, jitted.explain()
    assert runs.forward - 10 > 3  # the record and trace passes, and eager samples
    info = coefficient.cache_info()
    assert (info.misses, info.currsize) == (1, 1)
    assert info.hits == runs.forward - 1  # every eager run after the first hit


def test_the_guard_reads_a_cache_once_per_call() -> None:
    """One ``cache_info()`` per cached function per guard check (its three reads share it)."""

    @functools.cache
    def gain() -> float:
        return CFG.k

    calls = Counter()
    info = gain.cache_info

    def counted() -> Any:
        calls.forward += 1
        return info()

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * gain()

    jitted, x = ptj.jit(step, fallback="off"), torch.ones(3)
    gain.__dict__["cache_info"] = counted  # shadows the C method: what the guard calls (set
    try:  # before the trace: what is set on a cached function is guarded, probe 49)
        jitted(x)
        jitted.wait_compiled()
        jitted(x)
        calls.forward = 0
        for _ in range(5):
            jitted(x)
    finally:
        del gain.__dict__["cache_info"]
    assert calls.forward == 5
    assert jitted.num_traces == 1


class Seen:
    """What the step saw as ``table``: test instrumentation (a library's class, as Counter)."""

    __slots__ = ("value",)


Seen.__module__ = "builtins"


def test_the_observer_is_gone_after_the_record_pass() -> None:
    """The record pass rebinds the global to an observer, and back; the observer calls the
    cached function (its cache counts the call) and answers for it."""
    seen = Seen()

    def step(x: torch.Tensor) -> torch.Tensor:
        if not hasattr(seen, "value"):  # the record pass's (the trace pass runs it too)
            seen.value = table
        return x * table()[0]

    ptj.jit(step)(torch.ones(3))
    assert is_cache(table) and not is_cache(seen.value)
    assert seen.value.cache_info() == table.cache_info()
    assert seen.value.__wrapped__ is table.__wrapped__


@functools.cache
def schedule() -> Any:
    return iter([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])


def test_an_iterator_a_cached_function_returns_runs_the_step_eagerly_warned() -> None:
    """The step takes the next item of the iterator a cached function returned: probe round
    35 found the compiled calls repeating the traced item (1, 2, 2, 2, ...). It runs eagerly,
    warned, as a step reading any iterator does, and takes each item once."""
    schedule.cache_clear()
    jitted = ptj.jit(lambda x: x * next(schedule()))
    with pytest.warns(ptj.JitWarning, match=r"schedule\(\) returned a list_iterator object"):
        taken = [float(jitted(torch.ones(1))) for _ in range(6)]
    assert taken == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
