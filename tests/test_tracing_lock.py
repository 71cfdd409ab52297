"""The tracing lock (``engines/_tracing_lock.py``): sessions for whole specializations, and a
compile that lends the lock while inductor's C++ compiler runs (NOTE [one tracing thread]).

Nothing here reads a clock: threads are ordered by events, and where a test waits for another
thread to reach a state it polls that state, with a generous deadline that only a hang meets.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import SETTLE_S, Counter
from torch.fx.experimental.proxy_tensor import make_fx

import phi_torch_jit as ptj
from phi_torch_jit._compat import around_cpp_builds, wrap_cpp_builds
from phi_torch_jit._compat._private import CPP_BUILD
from phi_torch_jit._loops import Captured, capture_loops
from phi_torch_jit.engines import _background
from phi_torch_jit.engines._capture import CAPTURE_LOCK
from phi_torch_jit.engines._tracing_lock import TracingLock
from phi_torch_jit.engines.auto import AutoEngine
from phi_torch_jit.engines.compile import Compilable
from phi_torch_jit.errors import NotNow

DEADLINE_S = 60.0
"""How long a test waits for another thread to reach a state: only a hang reaches it."""


@pytest.fixture(autouse=True)
def _compiles_settle() -> Iterator[None]:
    yield
    assert _background.wait_idle(SETTLE_S), "a background compile did not finish"


def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, "another thread never reached the state"
        time.sleep(0.001)


class _Lender(threading.Thread):
    """A holder that lends the lock around a 'build' that ends when ``built`` is set."""

    def __init__(self, lock: TracingLock) -> None:
        super().__init__(daemon=True)
        self.lock = lock
        self.lending = threading.Event()
        self.built = threading.Event()
        self.resumed = threading.Event()
        self.release_now = threading.Event()

    def run(self) -> None:
        with self.lock:
            with self.lock.lent():
                self.lending.set()
                assert self.built.wait(DEADLINE_S)
            self.resumed.set()
            assert self.release_now.wait(DEADLINE_S)


def _in_thread(fn: Callable[[], Any]) -> Any:
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join(DEADLINE_S)
    return result[0]


def test_a_session_keeps_waiting_holders_and_other_sessions_out_until_it_ends() -> None:
    """A holder that waits (the compile thread) waits for the session's end; another
    thread's try gets the lock only while the session's thread holds nothing, as before
    sessions (autograd's device thread compiling a custom backward in a record pass)."""
    lock = TracingLock()
    session = lock.session()
    assert session is not None
    with session:
        assert lock.reserved_here() and not lock.borrowed_here()
        assert _in_thread(lock.session) is None
        got = threading.Event()
        waiter = threading.Thread(target=lambda: (lock.acquire(), got.set(), lock.release()))
        waiter.start()
        assert lock.acquire(blocking=False)
        assert _in_thread(lambda: lock.acquire(blocking=False)) is False  # held: no try
        lock.release()

        def try_once() -> bool:
            if not lock.acquire(blocking=False):
                return False
            lock.release()
            return True

        assert _in_thread(try_once) is True  # the session's thread holds nothing
        assert not got.is_set()
    waiter.join(DEADLINE_S)
    assert got.is_set() and not lock.locked()


def test_inside_its_session_a_thread_acquires_as_it_would_a_plain_lock() -> None:
    lock = TracingLock()
    session = lock.session()
    assert session is not None
    with session:
        assert lock.acquire(blocking=False)
        assert not lock.acquire(blocking=False)  # one acquisition at a time, as before
        with pytest.raises(RuntimeError, match="not reentrant"):
            lock.acquire()
        lock.release()
        inner = lock.session()  # a session inside the session is the same one
        assert inner is not None
        with inner:
            assert lock.reserved_here()
        assert lock.reserved_here()
    assert not lock.reserved_here() and not lock.locked()
    with pytest.raises(RuntimeError, match="non-holder"):
        lock.release()


def test_a_holder_lends_the_lock_to_one_session_and_takes_it_back_when_that_ends() -> None:
    lock = TracingLock()
    lender = _Lender(lock)
    lender.start()
    assert lender.lending.wait(DEADLINE_S)
    assert _in_thread(lambda: lock.acquire(blocking=False)) is False  # holders never borrow
    session = lock.session()
    assert session is not None and lock.borrowed == 1
    with session:
        assert lock.borrowed_here()
        assert _in_thread(lock.session) is None  # one session at a time
        lender.built.set()  # the build ends: the lender waits for this session
        _until(lambda: lock.locked() and lock._reclaiming)
        assert not lender.resumed.is_set()
        assert _in_thread(lock.session) is None  # none starts while it takes it back
    assert lender.resumed.wait(DEADLINE_S)
    assert lock.session() is None and not lock.acquire(blocking=False)
    lender.release_now.set()
    lender.join(DEADLINE_S)
    assert lock.acquire(blocking=False)
    lock.release()


def test_only_a_plain_holder_lends() -> None:
    """A session's own compile (a block calling our ops, compiled on the caller's thread) keeps
    the lock through its builds: its thread is not a plain holder."""
    lock = TracingLock()
    session = lock.session()
    assert session is not None
    with session, lock, lock.lent():
        assert _in_thread(lock.session) is None and not lock.borrowed_here()
    with lock.lent():  # not held at all: nothing to lend, nothing to take back after
        assert not lock.locked()
    assert lock.acquire(blocking=False)
    lock.release()


def _compilable() -> Compilable:
    x = torch.randn(4)
    graph = make_fx(lambda t: (t.sin() * 2,))(x)
    return Compilable(graph, (x,), AutoEngine(backend="aot_eager"), 1)


def test_a_backend_compile_in_a_borrowed_session_is_refused_with_not_now() -> None:
    """Inductor's settings are process-wide: a compile nested inside a paused one would run
    with the paused one's. Captures may borrow the lock; compiles may not."""
    target = _compilable()
    lender = _Lender(CAPTURE_LOCK)
    lender.start()
    try:
        assert lender.lending.wait(DEADLINE_S)
        session = CAPTURE_LOCK.session()
        assert session is not None
        with session:
            with pytest.raises(NotNow, match="paused"):
                target.compile()
    finally:
        lender.built.set()
        lender.release_now.set()
        lender.join(DEADLINE_S)
    x = torch.randn(4)
    assert torch.allclose(target.compile()(x)[0], x.sin() * 2)


def _cg(b: torch.Tensor) -> torch.Tensor:
    x = torch.zeros_like(b)
    r = b.clone()
    rs = (r * r).sum()
    it = 0
    while bool(rs > 1e-20) and it < 50:
        x = x + 0.5 * r
        r = r * 0.5
        rs = (r * r).sum()
        it += 1
    return x


def test_a_block_compile_refused_for_now_runs_eagerly_and_is_tried_again() -> None:
    """Before, a ``NotNow`` from the block's compile was kept as the reason why that input
    signature runs eagerly, for good."""
    refusals = Counter()

    def compile_graph(graph: torch.fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> Any:
        refusals.forward += 1
        if refusals.forward == 1:
            raise NotNow("a compile is paused")
        return graph.forward

    captured = capture_loops(_cg, "cg", compile_graph, block=4)
    assert isinstance(captured, Captured), captured
    (loop,) = captured.loops
    b = torch.randn(8, dtype=torch.float64)
    assert torch.equal(captured.function(b), _cg(b))
    assert loop.blocks_run == 0 and not loop.eager_reasons and not loop.programs
    assert torch.equal(captured.function(b), _cg(b))
    assert refusals.forward == 2 and loop.blocks_run > 0 and not loop.eager_reasons


@pytest.mark.filterwarnings("ignore::phi_torch_jit.JitWarning")  # it appends: runs eagerly
def test_wait_compiled_inside_a_specialization_returns_at_once() -> None:
    """The compile thread waits for a specialization to end; waiting for it from inside one
    (the record pass runs the Python) would never return."""
    answers: list[bool] = []

    def step(x: torch.Tensor) -> torch.Tensor:
        answers.append(ptj.wait_compiled())
        return x + 1

    jitted = ptj.jit(step, engine="auto", backend="aot_eager")
    jitted(torch.ones(2))
    assert answers[0] is False
    assert ptj.wait_compiled(DEADLINE_S)


def test_inductors_cpp_compiler_runs_inside_the_hook_and_lends_the_tracing_lock(
    tmp_path: Path,
) -> None:
    """The real wrapper around inductor's compiler call: a command that waits for a file runs
    with the lock lent by the thread that holds it; a session borrows it meanwhile."""
    wrap_cpp_builds()
    original = CPP_BUILD.find()
    build = getattr(importlib.import_module(original.__module__), original.__name__)
    assert build is not original and build.__wrapped__ is original
    flag = tmp_path / "built"
    command = f"sh -c 'until [ -e {flag} ]; do sleep 0.01; done'"
    done = threading.Event()

    def compile_thread() -> None:
        with CAPTURE_LOCK:
            build(command, str(tmp_path))
        done.set()

    thread = threading.Thread(target=compile_thread, daemon=True)
    thread.start()
    borrowed: list[bool] = []

    def borrow() -> bool:
        session = CAPTURE_LOCK.session()
        if session is None:
            return False
        with session:
            if not CAPTURE_LOCK.borrowed_here():  # the thread has not taken the lock yet
                return False
            borrowed.append(True)
            flag.touch()
        return True

    try:
        _until(borrow)
    finally:
        flag.touch()
    thread.join(DEADLINE_S)
    assert borrowed == [True] and done.is_set()
    calls: list[str] = []

    class _Seen:
        def __enter__(self) -> None:
            calls.append("enter")

        def __exit__(self, *exc: object) -> None:
            calls.append("exit")

    around_cpp_builds(_Seen)
    try:
        build("true", str(tmp_path))
    finally:
        around_cpp_builds(CAPTURE_LOCK.lent)
    assert calls == ["enter", "exit"]


def test_eager_modules_of_other_threads_run_unpatched_while_a_holder_traces() -> None:
    """FX's tracer replaces ``nn.Module.__call__`` and ``__getattr__`` on the class while it
    traces: during engine auto's background compile, the caller's own eager modules went
    through the tracer's wrapper and raised NameError ("not installed as a submodule"; found
    by a probe, 2328 of 764,800 calls). While a thread holds the tracing lock, those
    replacements act on the tracing thread only. The trace here is held mid-way by events."""
    inside, done = threading.Event(), threading.Event()

    class Waiting(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            inside.set()
            assert done.wait(timeout=120)
            return self.inner(x)

    traced: list[Any] = []

    def trace() -> None:
        with CAPTURE_LOCK:
            traced.append(torch.fx.symbolic_trace(Waiting()))

    other = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Tanh())
    x = torch.ones(1, 2)
    want = other(x)
    thread = threading.Thread(target=trace)
    thread.start()
    try:
        assert inside.wait(timeout=120)
        assert torch.nn.Module.__call__ is not torch.nn.Module.__dict__.get("_wrapped_call_impl")
        torch.testing.assert_close(other(x), want)  # raised NameError through FX's wrapper
        assert other[0].weight is other._modules["0"].weight
    finally:
        done.set()
        thread.join(timeout=120)
    assert traced and "inner" in traced[0].code  # the trace itself still saw its modules
    assert torch.nn.Module.__call__ is torch.nn.Module._wrapped_call_impl  # all put back
