"""A core for our background work (engines/_spare_core.py): while a compile of ours runs
beside the caller, or the compile worker starts, engine "auto"'s served calls use one
intra-op thread fewer, and every thread again once it is done.

Counts and thread numbers seen inside calls, never a clock.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import SETTLE_S, program_of

import phi_torch_jit as ptj
from phi_torch_jit.engines import _background, _compile_process, _spare_core


@pytest.fixture(autouse=True)
def _no_compile_of_others() -> None:
    """No background compile an earlier test left running holds a core, nor a worker process
    that is still starting."""
    assert _background.wait_idle(SETTLE_S)
    assert _compile_process._WORKER.booted.wait(120)


@pytest.fixture
def two_cores(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Torch's threads fill the two cores this process may use, whatever the machine."""
    before = torch.get_num_threads()
    monkeypatch.setattr(_spare_core, "CORES", 2)
    monkeypatch.setattr(_spare_core, "OPENMP", True)
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _threads_seen(*_: Any) -> int:
    return torch.get_num_threads()


def test_one_thread_fewer_only_while_background_work_of_ours_uses_a_core(two_cores: None) -> None:
    assert not _spare_core.busy()
    assert _spare_core.with_fewer_threads(_threads_seen) == 2
    with _spare_core.taken():
        assert _spare_core.busy()
        assert _spare_core.with_fewer_threads(_threads_seen) == 1
        assert torch.get_num_threads() == 2  # set back after the call
        with pytest.raises(ValueError):  # and after a call that raised
            _spare_core.with_fewer_threads(int, "not a number")
        assert torch.get_num_threads() == 2
    assert not _spare_core.busy()
    assert _spare_core.with_fewer_threads(_threads_seen) == 2


def test_threads_are_left_alone_where_they_leave_a_core_free_or_were_changed_in_the_call(
    two_cores: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _spare_core.taken():
        monkeypatch.setattr(_spare_core, "CORES", 4)  # 2 threads on 4 cores: two are free
        assert _spare_core.with_fewer_threads(_threads_seen) == 2
        monkeypatch.setattr(_spare_core, "CORES", 2)
        monkeypatch.setattr(_spare_core, "OPENMP", False)  # a native pool keeps its size
        assert _spare_core.with_fewer_threads(_threads_seen) == 2
        monkeypatch.setattr(_spare_core, "OPENMP", True)
        _spare_core.with_fewer_threads(torch.set_num_threads, 3)  # the call's own choice
        assert torch.get_num_threads() == 3


class _Gate:
    """A backend that waits until the test opens it: a compile 'runs' meanwhile."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.entered = threading.Event()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.entered.set()
        assert self.opened.wait(60)
        return gm.forward


def test_calls_served_while_a_background_compile_runs_use_one_thread_fewer(
    two_cores: None,
) -> None:
    gate = _Gate()
    jitted = ptj.jit(lambda x: x.sin() * 2, engine="auto", backend=gate, fallback="off")
    x = torch.randn(5)
    jitted(x)  # the record pass: the user's Python, all threads
    program = program_of(jitted)
    fast, seen = program._fast, []

    def spy(*inputs: torch.Tensor) -> Any:
        seen.append(torch.get_num_threads())
        return fast(*inputs)

    program._fast = spy
    jitted(x)  # the fast tier; nothing compiles yet
    jitted(x)  # queues the compile, then runs while it starts
    try:
        assert gate.entered.wait(60)
        assert _spare_core.busy()
        assert torch.allclose(jitted(x), x.sin() * 2)
        assert seen[0] == 2 and seen[-1] == 1
        assert torch.get_num_threads() == 2
    finally:
        gate.opened.set()
    assert jitted.wait_compiled(SETTLE_S)
    assert not _spare_core.busy()


def test_the_worker_process_holds_a_core_until_its_imports_are_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real worker says when its imports (3-5 s of torch and inductor) are done; a stand-in
    that never says so holds the core until it ends."""
    _compile_process.stop_worker()
    worker = _compile_process._WORKER
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(_compile_process.stop_worker)
        worker.start_soon()
        assert _compile_process.worker_pid() is not None
        assert _spare_core.busy() or worker.booted.is_set()  # (a very fast machine)
        assert worker.booted.wait(120)
        assert not _spare_core.busy()
        _compile_process.stop_worker()
        monkeypatch.setattr(_compile_process, "_BOOT", "import sys; sys.stdin.read()")
        worker.start_soon()
        assert _spare_core.busy()
        _compile_process.stop_worker()
        assert worker.booted.wait(60)
        assert not _spare_core.busy()


def test_a_compile_inside_a_call_on_one_thread_fewer_sees_every_thread(two_cores: None) -> None:
    """Inductor makes its kernels for the thread count it sees and keys its caches by it: a
    compile on the caller's thread inside a served call (here: compile_on="caller", while
    another compile of ours holds a core) must not make them for one thread."""
    seen: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        seen.append(torch.get_num_threads())
        return gm.forward

    jitted = ptj.jit(
        lambda x: x.cos() - 1, engine="auto", backend=backend, compile_on="caller", fallback="off"
    )
    x = torch.randn(5)
    with _spare_core.taken():
        for _ in range(3):
            assert torch.allclose(jitted(x), x.cos() - 1)
        assert _spare_core.calls > 0
    assert seen == [2]
    assert torch.get_num_threads() == 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")
def test_a_forked_child_holds_no_core_for_its_parents_compile() -> None:
    with _spare_core.taken():
        pid = os.fork()
        if pid == 0:  # the child: its parent's compile thread and worker are not its own
            os._exit(0 if not _spare_core.busy() else 1)
        _, status = os.waitpid(pid, 0)
        assert _spare_core.busy()
    assert os.waitstatus_to_exitcode(status) == 0


class _Recorder:
    """A background job that records the compile thread's intra-op thread count."""

    def __init__(self) -> None:
        self.threads: list[int] = []
        self.done = threading.Event()

    def upgrade(self) -> None:
        self.threads.append(torch.get_num_threads())
        self.done.set()


def test_the_compile_thread_started_inside_a_call_on_one_thread_fewer_uses_every_thread(
    two_cores: None,
) -> None:
    """A thread takes torch's process-wide count at its first op: a compile thread started
    inside a served call on one thread fewer took that count, and inductor made its kernels
    (and the worker's request) for it."""
    for _ in range(1200):  # the compile thread ends after a second without work (60 s bound)
        if not _background.worker_alive():
            break
        threading.Event().wait(0.05)
    assert not _background.worker_alive()
    job = _Recorder()

    def served_call() -> bool:
        assert _background.submit(job)
        return job.done.wait(60)  # the thread started and ran the job during this call

    with _spare_core.taken():
        assert _spare_core.with_fewer_threads(served_call)
    assert job.threads == [2]
