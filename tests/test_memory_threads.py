"""Memory and concurrency (issue 6, section 4)."""

from __future__ import annotations

import gc
import os
import threading
import weakref
from typing import Any

import pytest
import torch
from helpers import cg_loop, make_solve, seeded
from torch import nn

import phi_torch_jit as ptj
from phi_torch_jit import _record, _trace
from phi_torch_jit._function import interception_installed


def _static_values(step: Any) -> list[Any]:
    return [s.key[0][1][1][2] for s in step.specializations]


def test_max_traces_drops_least_recently_used() -> None:
    step = ptj.jit(lambda x, n: x * n, max_traces=2)
    x = torch.ones(1)
    step(x, 1)
    step(x, 2)
    step(x, 1)  # 1 is now the most recently used
    with pytest.warns(ptj.JitWarning, match="least recently used specializations are dropped"):
        step(x, 3)
    assert sorted(_static_values(step)) == [1, 3]  # 2 was dropped
    assert step.num_traces == 3
    step(x, 2)  # dropped: traced again
    assert step.num_traces == 4 and len(step.specializations) == 2


def test_clear_caches_frees_compiled_programs() -> None:
    solve = make_solve()
    step = ptj.jit(lambda b, k: solve(b, k).sin())
    step(torch.ones(4), torch.tensor(0.1))
    specialization = weakref.ref(step.specializations[0])
    call = weakref.ref(step.specializations[0].calls[0])  # holds the op's torch.library
    ptj.clear_caches()
    gc.collect()
    assert step.specializations == () and specialization() is None and call() is None
    step(torch.ones(4), torch.tensor(0.1))
    assert step.num_traces == 2


def test_recorded_tensors_are_released_after_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    refs: list[weakref.ref[torch.Tensor]] = []
    original_of = _record.RecordedCall.of.__func__  # type: ignore[attr-defined]
    original_input = _trace.trace_input

    def spy_of(cls: Any, function: Any, args: Any, outputs: Any, context: Any = None) -> Any:
        recorded = original_of(cls, function, args, outputs, context)
        refs.extend(
            weakref.ref(t) for t in (*recorded.args, *recorded.outputs) if torch.is_tensor(t)
        )
        return recorded

    def spy_input(t: torch.Tensor) -> torch.Tensor:
        copy = original_input(t)
        refs.append(weakref.ref(copy))
        return copy

    monkeypatch.setattr(_record.RecordedCall, "of", classmethod(spy_of))
    monkeypatch.setattr(_trace, "trace_input", spy_input)
    solve = make_solve()
    step = ptj.jit(lambda b, k: solve(b, k) * 2)
    b = torch.randn(64, requires_grad=True)
    step(b, torch.tensor(0.3))
    step(b, torch.tensor(0.3)).sum().backward()
    gc.collect()
    assert len(refs) >= 4 and all(r() is None for r in refs)


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_resident_memory_does_not_grow_with_calls() -> None:
    solve = make_solve()
    net = nn.Linear(32, 32)
    step = ptj.jit(lambda u, k: solve(u + net(u), k))
    u, k = torch.randn(32, requires_grad=True), torch.tensor(0.2)
    for _ in range(300):
        step(u, k).sum().backward()
    gc.collect()
    before = _rss()
    for _ in range(2000):
        step(u, k).sum().backward()
    gc.collect()
    assert _rss() - before < 0.05 * before  # benchmarks/bench_memory.py runs 10,000 calls


def test_four_threads_two_functions_racing_first_calls() -> None:
    solve = make_solve()
    nets = [nn.Linear(8, 8), nn.Linear(8, 8)]
    steps = [ptj.jit(lambda u, k, net=net: solve(u + net(u), k)) for net in nets]
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            generator = seeded(seed)
            barrier.wait(10)
            for i in range(200):
                which = (i + seed) % 2
                u = torch.randn(8, generator=generator)
                k = torch.tensor(0.25)
                got = steps[which](u, k)
                with torch.no_grad():
                    want = cg_loop(u + nets[which](u), k)
                assert torch.allclose(got, want, atol=1e-4)
        except BaseException as error:  # re-raised in the main thread below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert [s.num_traces for s in steps] == [1, 1]


class _Interrupt:
    """Raises KeyboardInterrupt on the n-th call of ``where``."""

    def __init__(self, where: str, n: int) -> None:
        self.where, self.n, self.calls = where, n, 0

    def tick(self, where: str) -> None:
        if where == self.where:
            self.calls += 1
            if self.calls == self.n:
                raise KeyboardInterrupt(where)


def _assert_clean() -> None:
    from phi_torch_jit._context import current_frame

    assert current_frame() is None
    assert not interception_installed()
    assert "__bool__" not in torch.Tensor.__dict__
    assert not nn.modules.module._global_forward_pre_hooks


@pytest.mark.parametrize(("where", "n"), [("forward", 1), ("forward", 2), ("gradient", 1)])
def test_keyboard_interrupt_leaves_no_state(where: str, n: int) -> None:
    interrupt = _Interrupt(where, n)

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def gradient(inputs: Any, outputs: Any, grads: Any) -> tuple[torch.Tensor]:
        interrupt.tick("gradient")
        return (grads[0] * 2,)

    f = ptj.custom_gradient(double, gradient)

    def step(x: torch.Tensor) -> torch.Tensor:
        interrupt.tick("forward")  # 1st: record pass, 2nd: trace pass
        return f(x) + 1

    jitted = ptj.jit(step, side_effects="trace")  # counts its passes: JAX's rule
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(KeyboardInterrupt):
        jitted(x).sum().backward()
        jitted(x).sum().backward()  # the compiled backward is built here
    _assert_clean()
    for _ in range(2):
        x.grad = None
        out = jitted(x)
        out.sum().backward()
        assert torch.equal(out, x * 2 + 1) and torch.equal(x.grad, torch.full((3,), 2.0))
