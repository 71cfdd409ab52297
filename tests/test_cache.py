"""Stage 5: the specialization cache (LRU, eviction, lock-free readers) and serving a call."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

import phi_torch_jit as ptj
from phi_torch_jit._cache import SpecializationCache
from phi_torch_jit._guards import ModuleGuard
from phi_torch_jit._specialization import (
    GuardFailure,
    Miss,
    Specialization,
    Timings,
    retrace_reason,
    run_first_valid,
)
from phi_torch_jit._value_guards import ValueGuard


def _spec(key: Any, program: Any = None, **fields: Any) -> Specialization:
    program = program or (lambda *t: (t[0] + 1,))
    return Specialization(
        key=key,
        program=program,
        output_spec=("T",),
        modules=(),
        calls=(),
        timings=Timings(0.0, 0.0, 0.0),
        tracer_warnings=(),
        guard=fields.pop("guard", None),
        n_outputs=1,
        **fields,
    )


def test_newest_first_per_key_and_lru_eviction_over_keys() -> None:
    cache = SpecializationCache(max_size=3)
    a1, a2, b1 = _spec("a"), _spec("a"), _spec("b")
    assert cache.insert(a1) == [] and cache.insert(a2) == [] and cache.insert(b1) == []
    assert cache.lookup("a") == (a2, a1) and len(cache) == 3
    cache.touch("a")  # "b" is now the least recently used key
    c1 = _spec("c")
    assert cache.insert(c1) == [b1]
    assert cache.lookup("b") == () and list(cache) == [a2, a1, c1]
    assert cache.insert(_spec("d")) == [a1]  # the oldest entry of the least recently used key
    cache.clear()
    assert len(cache) == 0 and cache.lookup("a") == ()


def test_clear_caches_clears_every_live_cache() -> None:
    first, second = SpecializationCache(2), SpecializationCache(2)
    first.insert(_spec("a"))
    second.insert(_spec("b"))
    ptj.clear_caches()
    assert len(first) == len(second) == 0


def test_readers_never_see_an_entry_list_being_evicted() -> None:
    """Readers take no lock; a writer evicting all the time must never break them."""
    cache = SpecializationCache(max_size=2)
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                for key in "abc":
                    entries = cache.lookup(key)
                    assert all(e.key == key for e in entries) and len(entries) <= 2
                    run_first_valid(entries, [torch.zeros(1)])
                    cache.touch(key)
                len(cache), list(cache)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for i in range(3000):
        cache.insert(_spec("abc"[i % 3]))
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert len(cache) == 2


@pytest.mark.filterwarnings("ignore::phi_torch_jit.JitWarning")  # max_traces passed, on purpose
def test_threads_racing_with_eviction_get_right_results() -> None:
    @ptj.jit(max_traces=2)
    def step(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + x.shape[0]

    shapes = [1, 2, 3, 4]
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for i in range(60):
                n = shapes[(i + offset) % 4]
                x = torch.full((n,), float(i))
                assert torch.equal(step(x), x * 2 + n)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert len(step.specializations) <= 2


def test_serving_skips_entries_whose_module_guard_fails() -> None:
    net = nn.Dropout()
    guarded = _spec("k", guard=ModuleGuard([net]), program=lambda x: (x * 10,))
    other = _spec("k", program=lambda x: (x * 20,))
    x = torch.ones(1)
    assert torch.equal(run_first_valid([guarded, other], [x]), x * 10)
    net.eval()
    assert torch.equal(run_first_valid([guarded, other], [x]), x * 20)
    miss = run_first_valid([guarded], [x])
    assert isinstance(miss, Miss) and miss.failure is None
    assert retrace_reason([guarded], miss) == "module Dropout training True -> False"
    assert retrace_reason([], None) is None


def test_failed_value_guard_restores_buffers_and_rng_and_says_why() -> None:
    buffer = torch.zeros(2)

    def program(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        buffer.add_(1.0)  # the compiled call's side effects ...
        torch.rand(3)  # ... on module state and the RNG
        return x + 1, (x.sum() > 0)

    spec = _spec(
        "k",
        program=program,
        value_guards=(ValueGuard("__bool__", True, "step.py:3"),),
        buffers=(buffer,),
        uses_rng=True,
    )
    assert torch.equal(run_first_valid([spec], [torch.ones(2)]), torch.full((2,), 2.0))
    assert torch.equal(buffer, torch.ones(2))  # a passing guard keeps the call's effects
    state = torch.get_rng_state()
    miss = run_first_valid([spec], [-torch.ones(2)])
    assert isinstance(miss, Miss) and isinstance(miss.failure, GuardFailure)
    assert miss.failure.description == "bool(...) at step.py:3: True -> False"
    assert torch.equal(buffer, torch.ones(2)) and torch.equal(torch.get_rng_state(), state)
    assert retrace_reason([spec], miss) == (
        "value guard failed: bool(...) at step.py:3: True -> False"
    )
