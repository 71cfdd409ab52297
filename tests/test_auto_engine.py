"""Engine "auto": fast tier at once, the backend's compile on a background thread, the switch.

The shared suite runs "auto" too, compiling on the caller's thread (``compile_on="caller"``)
so that trace counts are deterministic, with TorchScript and without it (``make
test-no-torchscript``). This module covers the tiers, the background switch and what can
happen while a compile runs. Backends here are aot_eager or small callables, so compiles
take well under a second; inductor itself is one slow test.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import (
    SETTLE_S,
    Counter,
    assert_grads_like_eager,
    lstm_pair,
    make_solve,
    parameter_grads,
    program_of,
)
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import phi_torch_jit as ptj
from phi_torch_jit import _compat
from phi_torch_jit.engines import _background
from phi_torch_jit.engines._capture import CAPTURE_LOCK
from phi_torch_jit.engines._light import straight_line, tensor_ops_only
from phi_torch_jit.engines.auto import AutoEngine


@pytest.fixture(autouse=True)
def _compiles_settle() -> Iterator[None]:
    yield
    assert _background.wait_idle(SETTLE_S), "a background compile did not finish"


def step_with_solve(solve: Any) -> Any:
    def step(u: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return torch.tanh(solve(u * 2, k)) + u

    return step


def test_first_call_records_then_fast_tier_then_switch_with_equal_results() -> None:
    counter = Counter()
    solve_step = step_with_solve(make_solve())

    def step(u: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        counter.forward += 1
        return solve_step(u, k)  # type: ignore[no-any-return]

    jitted = ptj.jit(step, engine="auto", backend="aot_eager")
    k = torch.tensor(0.5)
    inputs = [torch.randn(16) for _ in range(4)]
    assert torch.allclose(jitted(inputs[0], k), step(inputs[0], k))
    program = program_of(jitted)
    assert program.tier in ("torchscript-graph", "straight-line")
    assert "the backend compiles from the third call on" in jitted.explain()
    counter.forward = 0
    assert torch.allclose(jitted(inputs[1], k), step(inputs[1], k), atol=1e-6)  # queues it
    assert jitted.wait_compiled(SETTLE_S)
    assert program.tier == "aot_eager" and program.switched_after_calls == 1
    assert "tier: aot_eager (compiled in" in jitted.explain()
    for u in inputs[2:]:
        assert torch.allclose(jitted(u, k), step(u, k), atol=1e-6)
    assert jitted.num_traces == 1
    assert counter.forward == 3  # the eager calls since the reset: the jitted ones ran no Python


def test_training_gradients_match_eager_before_and_after_the_switch() -> None:
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    solve = make_solve()

    def loss(u: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (solve(net(u), k) ** 2).mean()

    jitted = ptj.jit(loss, engine="auto", backend="aot_eager")
    u, k = torch.randn(8), torch.tensor(0.3, requires_grad=True)

    def grads(f: Any) -> list[torch.Tensor]:
        net.zero_grad()
        k.grad = None
        f(u, k).backward()
        return [p.grad.clone() for p in net.parameters()] + [k.grad.clone()]  # type: ignore[union-attr]

    for _ in range(2):  # record, then the fast tier
        for got, want in zip(grads(jitted), grads(loss)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert jitted.wait_compiled(SETTLE_S) and program_of(jitted).tier == "aot_eager"
    for got, want in zip(grads(jitted), grads(loss)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_failing_backend_is_logged_once_and_the_fast_tier_stays(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        raise RuntimeError("no code generation today")

    jitted = ptj.jit(lambda x: torch.sin(x) * 2, engine="auto", backend=broken)
    x = torch.randn(5)
    with caplog.at_level(logging.WARNING, logger="phi_torch_jit"):
        for _ in range(3):
            assert torch.allclose(jitted(x), torch.sin(x) * 2)
        assert jitted.wait_compiled(SETTLE_S)
        assert torch.allclose(jitted(x), torch.sin(x) * 2)
    failures = [r for r in caplog.records if "no code generation today" in r.getMessage()]
    assert len(failures) == 1 and "stays on the" in failures[0].getMessage()
    assert "backend compile not used: RuntimeError: no code generation today" in jitted.explain()


class _Gate:
    """A backend that waits until the test opens it, so a compile is 'running' meanwhile;
    with ``lends``, it waits as inductor's C++ build does, lending the tracing lock."""

    def __init__(self, lends: bool = False) -> None:
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.compiles = 0
        self.lends = lends

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.compiles += 1
        with CAPTURE_LOCK.lent() if self.lends else contextlib.nullcontext():
            self.entered.set()
            assert self.opened.wait(60)
        return gm.forward


def test_calls_from_threads_while_compiling_are_served_and_compile_once() -> None:
    gate = _Gate()
    jitted = ptj.jit(lambda x: x.cos() + 1, engine="auto", backend=gate, fallback="off")
    x = torch.randn(6)
    for _ in range(3):  # the record pass, then the fast tier; its second call queues it
        jitted(x)
    assert gate.entered.wait(60)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(20):
                assert torch.allclose(jitted(x), x.cos() + 1)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not jitted.wait_compiled(0)  # still compiling, calls were served
    gate.opened.set()
    assert jitted.wait_compiled(SETTLE_S)
    assert gate.compiles == 1 and program_of(jitted).switched_after_calls == 82


@pytest.mark.parametrize("lends", [False, True], ids=["inductors-python", "cpp-build"])
def test_wait_compiled_waits_for_every_functions_compile_while_another_runs_its_python(
    request: pytest.FixtureRequest, lends: bool
) -> None:
    """``ptj.wait_compiled()`` waits for the compiles of every function. While one function's
    compile holds the tracing lock, another function's calls cannot be captured and run its
    Python (``bench_phiflow``'s ``ptj.jit`` steps ran at eager's speed for the whole compile
    of the ``install()`` variant timed before them); once it is done, they are captured.
    While the compile waits for its C++ build (``lends``), the lock is lent: the other
    function is captured then (before, it ran eagerly until the compile ended)."""
    gate = _Gate(lends)
    request.addfinalizer(gate.opened.set)
    counter = Counter()

    def other(x: torch.Tensor) -> torch.Tensor:
        counter.forward += 1
        return x.sin() + 1

    first = ptj.jit(lambda x: x.cos() * 2, engine="auto", backend=gate)
    second = ptj.jit(other, engine="auto", backend="aot_eager", fallback="off")
    x = torch.randn(5)
    for _ in range(3):  # its third call queues the compile, which the gate holds
        first(x)
    assert gate.entered.wait(60) and not ptj.wait_compiled(0)
    for _ in range(3):
        assert torch.allclose(second(x), x.sin() + 1)
    if lends:  # recorded and captured (the Python twice), then served by its program
        assert second.num_traces == 1 and counter.forward == 2 and CAPTURE_LOCK.borrowed
        assert not first.wait_compiled(0)  # still building
    else:
        assert second.num_traces == 0 and counter.forward == 3
    gate.opened.set()
    assert ptj.wait_compiled(SETTLE_S) and first.wait_compiled(0)
    assert torch.allclose(first(x), x.cos() * 2) and torch.allclose(second(x), x.sin() + 1)
    assert second.num_traces == 1
    with pytest.raises(ptj.UsageError, match="timeout"):
        ptj.wait_compiled(-1)
    with pytest.raises(ptj.UsageError, match=r"not a JitFunction.*its own \.wait_compiled\(\)"):
        ptj.wait_compiled(first)  # type: ignore[arg-type]


class _Doubled(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


def test_the_compile_waits_for_the_first_backward_and_a_signatures_third_call() -> None:
    """A custom function's backward compiles at its first backward and needs the tracing lock,
    which a background compile holds: queued at the second call, the compile made that
    backward run as Python until it ended (a PhiFlow gradient step's adjoint solves, 40 s).
    And a signature met twice may not come again (a simulation's first state, built
    otherwise than those its step returns): its compile kept the next signature from being
    traced, whose calls ran eagerly while it lasted. The compile is queued at the third."""
    gate = _Gate()
    jitted = ptj.jit(lambda x: _Doubled.apply(x).sin(), engine="auto", backend=gate)
    x = torch.randn(4, requires_grad=True)
    for _ in range(2):  # the record pass, then the fast tier with its backward
        (grad,) = torch.autograd.grad(jitted(x).sum(), x)
        torch.testing.assert_close(grad, 2 * (2 * x).cos())
    assert not gate.entered.is_set()
    assert "backward for needs_input_grad=(True,): traced" in jitted.explain()
    jitted(x)
    assert gate.entered.wait(60)  # queued by the third call
    gate.opened.set()
    assert jitted.wait_compiled(SETTLE_S)
    with torch.no_grad():
        inference = ptj.jit(lambda x: x.cos() * 3, engine="auto", backend=gate)
        inference(x)
        inference(x)
        assert _background.wait_idle(60) and gate.compiles == 1  # not queued yet
        assert torch.allclose(inference(x), x.cos() * 3)  # the third call queues it
        assert _background.wait_idle(60) and gate.compiles == 2


def test_a_signature_met_twice_does_not_keep_the_next_one_from_compiling(
    request: pytest.FixtureRequest,
) -> None:
    """``make demo``: the step is called twice on its first state, then on the states it
    returns, which PhiML builds with another structure (another signature). Queued at the
    second call, the first signature's compile held the tracing lock and the new signature's
    calls ran eagerly (the Python function) for the whole compile: 1.0x eager over 40 steps."""
    gate = _Gate()
    request.addfinalizer(gate.opened.set)
    counter = Counter()

    def step(x: torch.Tensor) -> torch.Tensor:
        counter.forward += 1
        return x.cos() * 2

    jitted = ptj.jit(step, engine="auto", backend=gate)
    first, later = torch.randn(3), torch.randn(4)
    jitted(first)
    jitted(first)
    for _ in range(3):  # its third call queues its compile, which the gate holds
        assert torch.allclose(jitted(later), later.cos() * 2)
    assert jitted.num_traces == 2 and gate.entered.wait(60)
    counter.forward = 0
    for _ in range(3):  # served by its captured program while the compile runs
        assert torch.allclose(jitted(later), later.cos() * 2)
    assert counter.forward == 0 and gate.compiles == 1
    gate.opened.set()
    assert jitted.wait_compiled(SETTLE_S)


def test_a_signature_met_twice_leaves_its_loop_blocks_uncompiled_too(
    request: pytest.FixtureRequest,
) -> None:
    """The same, with a captured loop (PhiFlow's pressure solve in ``make demo``): the block's
    compile, queued at the second call, held the tracing lock, and the next signature's calls
    ran eagerly for as long as it took (a cold inductor: the demo's 40 steps at 1.0-1.25x
    eager, in the runs where the compile thread took the lock first)."""
    gate = _Gate()
    request.addfinalizer(gate.opened.set)
    counter, solve_step = Counter(), step_with_solve(make_solve())

    def step(u: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        counter.forward += 1  # the Python step ran: a record pass or an eager call
        return solve_step(u, k)  # type: ignore[no-any-return]

    jitted = ptj.jit(step, engine="auto", backend=gate)
    k, first, later = torch.tensor(0.5), torch.randn(16), torch.randn(24)
    jitted(first, k)
    jitted(first, k)
    _background.wait_idle(5)  # a compile queued by now would have taken the lock
    assert not gate.entered.is_set()
    for _ in range(3):  # traced, then its third call queues the blocks and the compile
        torch.testing.assert_close(jitted(later, k), solve_step(later, k), atol=1e-6, rtol=1e-5)
    assert jitted.num_traces == 2 and "runs eagerly" not in jitted.explain()
    assert gate.entered.wait(60)
    want = solve_step(later, k)
    counter.forward = 0
    for _ in range(2):  # served by its captured program while the compile runs
        torch.testing.assert_close(jitted(later, k), want, atol=1e-6, rtol=1e-5)
    assert counter.forward == 0
    gate.opened.set()
    assert jitted.wait_compiled(SETTLE_S)


def test_a_new_signature_while_a_compile_traces_runs_eagerly_without_waiting() -> None:
    gate = _Gate()
    jitted = ptj.jit(lambda x: x * 3, engine="auto", backend=gate)
    x = torch.randn(3)
    for _ in range(3):
        jitted(x)
    assert gate.entered.wait(60)
    other = ptj.jit(lambda x: x + 1, engine="auto", backend=gate)
    results: list[bool] = []

    def calls() -> None:  # eager calls (the record pass), nothing cached, no waiting
        results.extend(torch.allclose(other(x), x + 1) for _ in range(3))

    caller = threading.Thread(target=calls, daemon=True)
    caller.start()
    caller.join(300)  # the gate stays closed: a call that waited for it would never end
    assert not caller.is_alive() and results == [True] * 3
    assert other.num_traces == 0
    gate.opened.set()
    assert jitted.wait_compiled(SETTLE_S)
    other(x)
    assert other.num_traces == 1


def test_clear_caches_skips_queued_compiles_and_the_thread_ends() -> None:
    gate = _Gate()
    first = ptj.jit(lambda x: x * 3, engine="auto", backend=gate)
    second = ptj.jit(lambda x: x - 2, engine="auto", backend=gate)
    x = torch.randn(3)
    first(x)
    second(x)  # both captured before any compile starts
    first(x)
    second(x)
    first(x)
    assert gate.entered.wait(60)  # first's compile runs
    second(x)  # queued behind it
    ptj.clear_caches()
    gate.opened.set()
    assert _background.wait_idle(60)
    assert gate.compiles == 1  # second's was dropped with its specialization
    assert torch.allclose(first(x), x * 3) and first.num_traces == 2
    deadline = time.monotonic() + 10
    while _background.worker_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _background.worker_alive()


def test_an_evicted_specialization_is_never_compiled() -> None:
    gate = _Gate()
    gate.opened.set()
    jitted = ptj.jit(lambda x: x - 1, engine="auto", backend=gate, max_traces=1)
    jitted(torch.randn(2))
    evicted = program_of(jitted)
    with pytest.warns(ptj.JitWarning):
        jitted(torch.randn(3))  # evicts the first before its compile was queued
    assert evicted.closed and evicted.wait(10)
    assert evicted.failure is not None and "dropped" in evicted.failure
    jitted(torch.randn(3))
    assert jitted.wait_compiled(SETTLE_S) and gate.compiles == 1


def test_exit_while_a_compile_runs_neither_hangs_nor_crashes() -> None:
    script = textwrap.dedent(
        """
        import time, torch, phi_torch_jit as ptj
        def slow(gm, example_inputs):
            time.sleep(3600)
            return gm.forward
        f = ptj.jit(lambda x: x + 1, engine="auto", backend=slow)
        f(torch.ones(2)); f(torch.ones(2))
        time.sleep(0.2)
        print("done", flush=True)
        """
    )
    # The compile sleeps an hour: an exit that waited for it would hit the timeout (a hang
    # detector with a wide margin for a loaded machine, not a timing of the exit).
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "done"


def test_exit_stops_a_compile_running_python_and_torch_ops() -> None:
    """A compile that runs Python calling torch's ops (as inductor's does) is stopped at exit:
    left running inside an op that released the GIL while the interpreter shut down, it
    aborted the process ("terminate called without an active exception", exit code 134; a
    script running a few steps of bench-peers (c) did so 3 times in 5)."""
    script = textwrap.dedent(
        """
        import threading, torch, phi_torch_jit as ptj
        started = threading.Event()
        def busy(gm, example_inputs):
            started.set()
            def lower(t):
                return torch.ops.aten.mul.Tensor(t, 1.0000001)
            t, rounds = torch.ones(2048), 0
            try:
                while True:
                    t = lower(t)
                    rounds += 1
            finally:  # (one writer at a time: two threads' prints may interleave)
                print("stopped", "after" if rounds > 1 else "before", "running", flush=True)
        f = ptj.jit(lambda x: x + 1, engine="auto", backend=busy)
        f(torch.ones(2)); f(torch.ones(2))
        assert not f.wait_compiled(0.01)  # queues the compile
        assert started.wait(600)  # (the compile thread may import torch's compilers first)
        assert not f.wait_compiled(0.5)
        print("done", flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["done", "stopped after running"], done.stdout


class _Hooks:
    """A backend that runs Python and allocates, as a compile does, and notes each change of
    the compile thread's profile hook (the one that yields the GIL) until it is released."""

    def __init__(self) -> None:
        self.changes: list[bool] = []
        self.off, self.on_again, self.release = (threading.Event() for _ in range(3))

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        kept: list[list[list[int]]] = []
        while not self.release.is_set():
            hooked = sys.getprofile() is not None
            if not self.changes or self.changes[-1] != hooked:
                self.changes.append(hooked)
                if self.changes == [True, False]:
                    self.off.set()
                elif self.changes == [True, False, True]:
                    self.on_again.set()
            kept.append([[i] for i in range(64)])  # a graph growing: garbage collections
        return gm.forward


def test_the_compile_yields_to_the_caller_unless_the_caller_waits_for_it() -> None:
    """The compile thread hands the GIL to the caller every 1000 Python calls through a
    profile hook, which doubled a warm start's loads while the caller only waited for them:
    while a caller waits for loads, the hook is off, and it is on again once the wait is over
    (at the thread's next garbage collection), so that a load that turned out to be a compile
    still yields, and still stops at exit."""
    hooks = _Hooks()
    f = ptj.jit(lambda x: x * 3, engine="auto", backend=hooks)
    x = torch.randn(5)
    for _ in range(3):  # the third call queues the compile
        torch.testing.assert_close(f(x), x * 3)
    try:
        with _background.awaited():  # a caller waiting, as for a warm start's loads
            assert hooks.off.wait(60), hooks.changes
        assert hooks.on_again.wait(60), hooks.changes
    finally:
        hooks.release.set()
    assert f.wait_compiled(SETTLE_S)
    assert hooks.changes == [True, False, True]
    torch.testing.assert_close(f(x), x * 3)


def test_disable_and_autocast_keep_the_fast_tier() -> None:
    disabled = ptj.jit(lambda x: x.exp(), engine="auto", backend="aot_eager", disable=True)
    x = torch.randn(4)
    disabled(x)
    assert disabled.wait_compiled(0) and "fast tier" in disabled.explain()
    casting = ptj.jit(lambda x: x @ x.T, engine="auto", backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m = torch.randn(4, 4)
        assert torch.allclose(casting(m).float(), (m @ m.T).float(), rtol=1e-2, atol=1e-2)
        casting(m)
    assert casting.wait_compiled(0) and "autocast is on" in casting.explain()


def _graph(fn: Any, *args: torch.Tensor) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="real", pre_dispatch=True)(*args)


def _mixed(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    y = torch.roll(x, 1, -1) * w + x[:, 1:3].sum(0).max()  # slice: no eager C function
    values, indices = torch.max(y, dim=1)  # getitem of a tuple
    with torch.no_grad():
        z = (y * 2).clamp_(min=0)
    return values, indices, z + y, torch.nn.functional.softplus(y).mean()


def test_straight_line_computes_what_the_graph_computes() -> None:
    x, w = torch.randn(4, 5), torch.randn(5, requires_grad=True)
    graph = _graph(_mixed, x, w)
    assert not tensor_ops_only(graph)  # the no_grad block: TorchScript would drop it
    ours = straight_line(graph)
    for got, want in zip(ours(x, w), graph(x, w)):
        assert torch.equal(got, want) and got.requires_grad == want.requires_grad
    (ours(x, w)[3]).backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()


def test_straight_line_calls_eager_c_functions_not_op_overloads() -> None:
    graph = _graph(lambda x: torch.roll(x, 1) + 1, torch.randn(3))
    assert tensor_ops_only(graph)
    runner = straight_line(graph)
    bound = list(runner.__globals__.values())
    assert any(f is torch.roll for f in bound) and any(f is torch.add for f in bound)


def _patch_out_torchscript(monkeypatch: pytest.MonkeyPatch) -> None:
    def removed(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("TorchScript removed by this test")

    monkeypatch.setattr(torch.jit, "trace", removed)
    monkeypatch.setattr(torch.jit, "script", removed)
    assert not _compat.torchscript_available()


def test_without_torchscript_auto_runs_straight_line_and_torchscript_runs_eagerly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _patch_out_torchscript(monkeypatch)
    counter = Counter()
    step = step_with_solve(make_solve(counter))
    k, u = torch.tensor(0.5), torch.randn(16)
    auto = ptj.jit(step, engine="auto", backend="aot_eager")
    for _ in range(3):
        assert torch.allclose(auto(u, k), step(u, k), atol=1e-6)
    assert program_of(auto).fast_tier == "straight-line"
    assert "forward: looped" in auto.explain()  # its loop captured, without TorchScript
    # The background compile first: a warnings.catch_warnings of torch's on that thread
    # swaps the process-wide filter list under pytest.warns (a full run once saw the
    # JitWarning raised as an error inside it).
    assert auto.wait_compiled(SETTLE_S) and program_of(auto).tier == "aot_eager"
    with caplog.at_level(logging.INFO, logger="phi_torch_jit"):
        script = ptj.jit(step, engine="torchscript")
        with pytest.warns(ptj.JitWarning, match="runs eagerly: TorchScript is unavailable"):
            assert torch.allclose(script(u, k), step(u, k))
    assert "TorchScript is unavailable" in script.explain()


def test_engine_options_reach_the_backend_settings() -> None:
    engine = AutoEngine("inductor", mode="max-autotune-no-cudagraphs", options={"debug": False})
    settings = engine.backend_settings()
    assert settings["debug"] is False and settings["max_autotune"] is True
    assert ptj.jit(torch.sin, engine="auto").engine.name == "auto"


@pytest.mark.slow
def test_inductor_tier_matches_eager_within_float_rounding() -> None:
    def step(u: torch.Tensor) -> torch.Tensor:
        for _ in range(5):
            u = u + 0.1 * (torch.roll(u, 1) - 2 * u + torch.roll(u, -1))
        return torch.tanh(u)

    jitted = ptj.jit(step, engine="auto")
    u = torch.randn(64)
    jitted(u)
    jitted(u)
    assert jitted.wait_compiled(SETTLE_S)
    assert program_of(jitted).tier == "inductor", jitted.explain()
    torch.testing.assert_close(jitted(u), step(u), rtol=1e-5, atol=1e-6)


def test_a_compile_does_not_rewind_the_callers_random_stream() -> None:
    from torch._dynamo import utils as dynamo_utils

    gate = _Gate()

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        with dynamo_utils.preserve_rng_state():  # as AOTAutograd and inductor do
            return gate(gm, example_inputs)

    jitted = ptj.jit(lambda x: x.sin(), engine="auto", backend=backend)
    x = torch.randn(3)
    jitted(x)
    jitted(x)
    torch.manual_seed(7)
    jitted(x)
    assert gate.entered.wait(60)
    during = torch.rand(4)  # drawn while the compile holds a saved RNG state
    gate.opened.set()
    assert jitted.wait_compiled(SETTLE_S)
    after = torch.rand(4)
    torch.manual_seed(7)
    assert torch.equal(torch.cat([during, after]), torch.rand(8))  # one stream, not repeated


def test_a_parameter_frozen_or_unfrozen_after_the_compile_gets_eager_gradients() -> None:
    torch.manual_seed(2)
    net = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
    jitted = ptj.jit(lambda x: net(x).sum(), engine="auto", backend="aot_eager")
    x = torch.randn(3, 6)

    def grads(f: Any) -> list[torch.Tensor | None]:
        return parameter_grads(f, net, x)

    def check() -> None:
        assert_grads_like_eager(jitted, lambda x: net(x).sum(), net, x)

    check()
    check()
    assert jitted.wait_compiled(SETTLE_S) and program_of(jitted).tier == "aot_eager"
    net[0].weight.requires_grad_(False)  # frozen: the compiled backward would still compute it
    check()
    net[0].weight.requires_grad_(True)
    check()  # the compiled tier again
    assert program_of(jitted).fast_calls_after_switch == 1
    assert "a parameter's requires_grad differed from the compile's" in jitted.explain()

    frozen_first = ptj.jit(lambda x: net(x).sum(), engine="auto", backend="aot_eager")
    net[2].bias.requires_grad_(False)
    frozen_grads = [grads(frozen_first), grads(frozen_first)]  # record, then the fast tier
    assert frozen_first.wait_compiled(SETTLE_S)
    net[2].bias.requires_grad_(True)  # unfrozen: the compiled backward has no gradient for it
    got, want = grads(frozen_first), grads(lambda x: net(x).sum())
    assert got[-1] is not None and want[-1] is not None
    torch.testing.assert_close(got[-1], want[-1])
    assert frozen_grads[1][-1] is None


def test_a_parameter_resized_through_data_after_the_compile_retraces(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def checking_backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        sizes = [t.shape for t in example_inputs]

        def run(*args: torch.Tensor) -> Any:  # as inductor's programs check their inputs
            for arg, size in zip(args, sizes):
                assert arg.shape == size, f"expected size {size}, got {arg.shape}"
            return gm(*args)

        return run

    net = nn.Linear(6, 6)
    jitted = ptj.jit(
        lambda x: (net(x) * 2).reshape(x.shape[0], -1),
        engine="auto", backend=checking_backend, compile_on="caller",
    )  # fmt: skip
    x = torch.randn(3, 6)
    jitted(x)
    jitted(x)
    assert program_of(jitted).tier == "checking_backend"
    net.weight.data, net.bias.data = torch.randn(4, 6), torch.randn(4)  # same Parameter objects
    with caplog.at_level(logging.INFO, logger="phi_torch_jit"):
        got = jitted(x)
    assert got.shape == (3, 4) and torch.allclose(got, net(x) * 2)
    assert jitted.num_traces == 2
    assert "changed dtype, device, shape or requires_grad" in caplog.text


@pytest.mark.parametrize("engine", ["auto", "compile"])
@pytest.mark.parametrize("change", ["double", "half", "data"])
def test_a_parameters_dtype_changed_in_place_after_the_compile_retraces(
    engine: str, change: str
) -> None:
    """``module.double()`` and ``p.data = ...`` keep the parameter objects (the module guard's
    identities hold) and inductor's kernels do not check dtypes: they read float64 bytes as
    float32 (garbage) and half ones past their end. The program must never see them."""
    misread: list[str] = []

    def kernel_like(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        dtypes = [t.dtype for t in example_inputs]

        def run(*args: torch.Tensor) -> Any:  # notes what inductor's kernels would misread
            misread.extend(
                f"{want} program given {arg.dtype}"
                for arg, want in zip(args, dtypes)
                if arg.dtype != want
            )
            return gm(*args)

        return run

    torch.manual_seed(4)
    lin = nn.Linear(3, 3)
    step = lambda x: x * lin.weight.sum() + lin.bias  # noqa: E731  reads, never calls, lin
    options: dict[str, Any] = {"compile_on": "caller"} if engine == "auto" else {}
    jitted = ptj.jit(step, engine=engine, backend=kernel_like, **options)
    x = torch.randn(3)
    for _ in range(3):
        torch.testing.assert_close(jitted(x), step(x))
    if engine == "auto":
        assert program_of(jitted).tier == "kernel_like"
    if change == "data":
        lin.weight.data = lin.weight.data.double()
    else:
        getattr(lin, change)()
    for _ in range(3):
        got, want = jitted(x), step(x)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)
    assert not misread
    assert jitted.num_traces == 2


def test_a_program_that_compiles_but_fails_to_run_leaves_the_fast_tier_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lstms = lstm_pair(seed=3)

    def loss_of(lstm: nn.LSTM) -> Any:
        return lambda x: lstm(x)[0][:, -1].square().mean()

    # A backend that raises when called stands in for a program that compiles and then fails
    # when it runs (AOTAutograd's LSTM did, before the backend got its time steps as ops).
    def fails_to_run(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        def run(*args: Any) -> Any:
            raise AssertionError("the program failed")

        return run

    for backend in ("aot_eager", fails_to_run):
        jitted = ptj.jit(loss_of(lstms[0]), engine="auto", backend=backend, compile_on="caller")
        with caplog.at_level(logging.WARNING, logger="phi_torch_jit"):
            for _ in range(3):
                x = torch.randn(2, 5, 4)
                got = torch.autograd.grad(jitted(x), list(lstms[0].parameters()))
                want = torch.autograd.grad(loss_of(lstms[1])(x), list(lstms[1].parameters()))
                for g, w in zip(got, want):
                    torch.testing.assert_close(g, w)
        if backend is fails_to_run:
            assert program_of(jitted).tier == program_of(jitted).fast_tier
            assert "its program failed: AssertionError" in jitted.explain()
        else:  # the LSTM's program runs (the backend gets its time steps as ops)
            assert program_of(jitted).tier == "aot_eager", jitted.explain()
    assert sum("its program failed" in r.message for r in caplog.records) == 1


def test_a_failed_first_run_of_a_program_leaves_eagers_random_draws() -> None:
    """The failed attempt drew dropout masks before it raised: they are undone, so the fast
    tier serving that call draws what eager code draws."""

    def fails_after_drawing(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        def run(*args: Any) -> Any:
            torch.rand(100)
            raise AssertionError("the program failed")

        return run

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x, 0.5) * 2

    jitted = ptj.jit(step, engine="auto", backend=fails_after_drawing, compile_on="caller")
    for seed in range(3):
        x = torch.ones(64)
        torch.manual_seed(seed)
        got = jitted(x)
        torch.manual_seed(seed)
        torch.testing.assert_close(got, step(x))


def test_compile_on_the_callers_thread_switches_inside_the_second_call() -> None:
    calls = Counter()

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        calls.forward += 1
        assert threading.current_thread() is threading.main_thread()
        return gm.forward

    jitted = ptj.jit(lambda x: x.sin() * 2, engine="auto", backend=backend, compile_on="caller")
    x = torch.randn(5)
    jitted(x)
    assert calls.forward == 0 and program_of(jitted).tier == "straight-line"  # no TorchScript
    assert torch.allclose(jitted(x), x.sin() * 2)
    assert calls.forward == 1 and program_of(jitted).tier == "backend"  # the backend's name
    assert program_of(jitted).switched_after_calls == 0
    assert "on the caller's thread" in jitted.explain()
    with pytest.raises(ptj.ConfigurationError, match="compile_on must be one of"):
        ptj.jit(torch.sin, engine="auto", compile_on="later")


def test_ctrl_c_while_waiting_for_a_compile_leaves_it_running_and_the_function_working(
    request: pytest.FixtureRequest,
) -> None:
    gate = _Gate()
    request.addfinalizer(gate.opened.set)  # a failed test must not leave the compile waiting
    jitted = ptj.jit(lambda x: x.cos() * 3, engine="auto", backend=gate)
    x = torch.randn(4)
    for _ in range(3):
        jitted(x)
    assert gate.entered.wait(60)
    main = threading.main_thread().ident
    assert main is not None
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    interrupted = threading.Event()

    def press_ctrl_c() -> None:  # until it lands: one signal was once lost in a full run
        while not interrupted.wait(0.2):
            signal.pthread_kill(main, signal.SIGINT)

    presser = threading.Thread(target=press_ctrl_c, daemon=True)
    presser.start()
    try:
        with pytest.raises(KeyboardInterrupt):  # a wait that ignored it would return False
            jitted.wait_compiled(SETTLE_S)  # the user gives up waiting
    finally:
        signal.signal(signal.SIGINT, lambda *args: None)  # a last press in flight lands here
        interrupted.set()
        presser.join()
    assert torch.allclose(jitted(x), x.cos() * 3)  # served by the fast tier meanwhile
    gate.opened.set()
    assert jitted.wait_compiled(SETTLE_S) and gate.compiles == 1
    assert torch.allclose(jitted(x), x.cos() * 3)


def test_ctrl_c_inside_a_compile_on_the_callers_thread_keeps_the_fast_tier() -> None:
    def interrupted(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        raise KeyboardInterrupt

    jitted = ptj.jit(lambda x: x + 2, engine="auto", backend=interrupted, compile_on="caller")
    x = torch.randn(3)
    jitted(x)
    with pytest.raises(KeyboardInterrupt):
        jitted(x)
    assert torch.equal(jitted(x), x + 2) and jitted.wait_compiled(0)
    assert "the compile was interrupted (KeyboardInterrupt)" in jitted.explain()


def test_a_loop_unrolled_by_values_stays_on_the_fast_tier() -> None:
    """Like engine "compile": the backend never compiles a path unrolled by more than
    UNROLLED tensor values (its compile held the capture lock for minutes)."""
    from phi_torch_jit.engines.compile import UNROLLED

    def until(x: torch.Tensor) -> torch.Tensor:
        for _ in range(UNROLLED + 10):
            if bool(x.abs().max() < 1e-3):
                break
            x = x * 0.9
        return x

    compiles: list[Any] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        compiles.append(gm)
        return gm.forward

    jitted = ptj.jit(until, engine="auto", backend=backend, compile_on="caller", fallback="off")
    x = torch.ones(3)
    for _ in range(4):
        assert torch.equal(jitted(x), until(x))
    assert compiles == [] and jitted.num_traces == 1
    assert "a loop unrolled by values" in jitted.explain()


class _Compiles:
    """A backend that notes, per compile, the thread and whether the graph is a block of a
    captured loop (its first input is the 0-d boolean ``go`` flag)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        first = example_inputs[0]
        block = first.dtype == torch.bool and first.dim() == 0
        self.calls.append((threading.current_thread().name, block))
        return gm.forward


def test_blocks_of_captured_loops_compile_in_the_background_after_the_first_call() -> None:
    """The first call serves the blocks of a custom function's captured loop straight-line
    and compiles nothing; from the second call on, the blocks and then the wrapper compile on
    the compile thread. A block compile queued during the first call held the tracing lock
    that call's capture needed, and the first call ran eagerly."""
    backend = _Compiles()
    step = step_with_solve(make_solve())
    jitted = ptj.jit(step, engine="auto", backend=backend)
    k, u = torch.tensor(0.5), torch.randn(16)
    assert torch.allclose(jitted(u, k), step(u, k), atol=1e-6)
    assert backend.calls == []
    assert jitted.num_traces == 1 and "runs eagerly" not in jitted.explain()
    assert "forward: looped" in jitted.explain()
    assert torch.allclose(jitted(u, k), step(u, k), atol=1e-6)
    assert jitted.wait_compiled(SETTLE_S)
    # the statements before the loop as a graph (loops.md, NOTE [a compiled prologue]), the
    # block, the wrapper
    assert [block for _, block in backend.calls] == [False, True, False]
    assert {thread for thread, _ in backend.calls} == {"phi_torch_jit compile"}
    for v in (torch.randn(16), u):
        assert torch.allclose(jitted(v, k), step(v, k), atol=1e-6)
    assert len(backend.calls) == 3 and jitted.num_traces == 1


def test_with_compile_on_the_caller_blocks_compile_in_the_first_call() -> None:
    backend = _Compiles()
    step = step_with_solve(make_solve())
    jitted = ptj.jit(step, engine="auto", backend=backend, compile_on="caller")
    k, u = torch.tensor(0.5), torch.randn(16)
    assert torch.allclose(jitted(u, k), step(u, k), atol=1e-6)
    here = threading.current_thread().name  # the statements before the loop, the block
    assert backend.calls == [(here, False), (here, True)]


def test_a_background_block_says_whether_it_runs_straight_line() -> None:
    """A library's loop may serve instead of straight-line blocks (PhiML's CG,
    ``adapters.phiml``): the block says which it runs, compiled once its compile switched it,
    straight-line for good where that compile failed."""
    from phi_torch_jit.engines import _block_tiers

    graph = torch.fx.symbolic_trace(lambda x: x * 2)

    def failing() -> Any:
        raise RuntimeError("no compiler")

    blocks = [
        _block_tiers.BackgroundBlock(graph, lambda: graph.forward, threading.Lock()),
        _block_tiers.BackgroundBlock(graph, failing, threading.Lock()),
    ]
    with _block_tiers._PENDING_LOCK:  # upgraded here, not on the compile thread
        for block in blocks:
            _block_tiers._PENDING.remove(block)
    assert all(block.straight_line for block in blocks)
    for block in blocks:
        block.upgrade()
    assert [block.straight_line for block in blocks] == [False, True]
    assert torch.equal(blocks[0](torch.ones(2)), torch.full((2,), 2.0))


def test_a_custom_loop_runs_as_python_until_its_blocks_are_compiled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Straight-line blocks run predicated iterations past convergence (1.9x eager on a CG):
    while the background compile of a custom function's loop blocks is held back, its forward
    runs the Python loop; once they are compiled, the blocks serve."""
    from phi_torch_jit._loops._block import CapturedLoop

    in_blocks: list[int] = []
    original = CapturedLoop._in_blocks

    def counting(self: CapturedLoop, *args: Any) -> Any:
        in_blocks.append(1)
        return original(self, *args)

    monkeypatch.setattr(CapturedLoop, "_in_blocks", counting)
    gate = _Gate()
    step = step_with_solve(make_solve())
    jitted = ptj.jit(step, engine="auto", backend=gate, fallback="off")
    k, u = torch.tensor(0.5), torch.randn(16)
    for _ in range(3):  # record (the check runs the blocks once), fast tier, compile queued
        in_blocks.clear()
        torch.testing.assert_close(jitted(u, k), step(u, k))
    assert gate.entered.wait(60) and not in_blocks  # the Python loop served
    assert "the Python loop while the blocks are not compiled" in jitted.explain()
    gate.opened.set()
    assert jitted.wait_compiled(SETTLE_S)
    torch.testing.assert_close(jitted(u, k), step(u, k))
    assert in_blocks  # compiled blocks now
