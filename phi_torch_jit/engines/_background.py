"""One daemon thread that compiles captured programs while their callers go on.

Jobs run one at a time, oldest first: a backend compiling two graphs at once would only
compete with itself and with the caller for the two cores and the GIL. The queue holds weak
references, so a program that ``clear_caches()``, ``max_traces`` eviction or garbage
collection dropped is skipped, and a compile that was running when its program was dropped
finishes into nothing. The thread ends when the queue has been empty for a second, and a new
job starts it again. At interpreter exit no new job starts; see NOTE [background compile at
exit] in docs/design.md.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import queue
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from ._spare_core import own_threads, taken

__all__ = ["Upgradable", "submit", "wait_idle", "awaited", "worker_alive", "exiting"]


class Upgradable(Protocol):
    """What the worker compiles: anything with an ``upgrade()`` that never raises."""

    def upgrade(self) -> None: ...


_IDLE_EXIT_S = 1.0

EXIT_WAIT_S = 10.0
"""How long interpreter exit waits for a compile that is running (queued ones are skipped)."""

_YIELD_EVERY_CALLS = 1000
_YIELD_S = 0.0002
_calls_since_yield = 0


class Abandoned(BaseException):
    """Raised inside a compile on the compile thread once the interpreter exits (NOTE
    [background compile at exit]); a BaseException, so that no ``except Exception`` of a
    backend takes it for a failure to recover from."""


def _yield_now_and_then(frame: Any, event: str, arg: Any) -> None:
    """Profile hook of the compile thread: a short sleep every 1000 Python calls hands the GIL
    to the caller's thread. Without it, every op of the caller that released the GIL waited up
    to a switch interval (5 ms) to get it back: steps ran 10-180x slower while inductor
    compiled, 2-5x with it (the compile takes 3-4x longer instead; docs/engines.md).

    Once the interpreter exits, the next of those points raises :class:`Abandoned` into the
    compile (Python then removes the hook): the compile unwinds in milliseconds instead of
    being left running inside torch while the interpreter shuts down.

    While the caller waits for a warm start's loads (:func:`awaited`), there is nothing to hand
    the GIL to, and the hook itself is the cost (Python runs its slow, traced path while one is
    set: (b)'s three loads took 0.30-0.36 s with it, 0.15-0.18 s without, and as much with a
    trace function in its place): the next of those points removes it, and :func:`rehooked`
    puts it back once the wait is over: at the next job, or at the compile thread's next
    garbage collection (a callback of Python's collector, :func:`_rehook_on_collection`: a
    compile builds graphs, and Python collects every 700 objects it keeps), so that a load
    that turned out to be a compile, and outlasted the wait, yields again and stops at exit.
    ``wait_compiled()`` does not take the hook off: a compile that keeps no objects would not
    get it back before the interpreter exits."""
    global _calls_since_yield
    if event != "call":
        return
    _calls_since_yield += 1
    if _calls_since_yield >= _YIELD_EVERY_CALLS:
        _calls_since_yield = 0
        if _WORKER.closing:
            raise Abandoned("the interpreter is exiting: the compile is stopped")
        if _WORKER.awaited:
            if _rehook_on_collection not in gc.callbacks:
                gc.callbacks.append(_rehook_on_collection)
            sys.setprofile(None)
            return
        time.sleep(_YIELD_S)


def _rehook_on_collection(phase: str, info: dict[str, int]) -> None:
    """A callback of Python's garbage collector, which runs on the thread that allocated: on
    the compile thread, the hook comes back once the caller no longer waits."""
    rehooked()


def rehooked() -> None:
    """On the compile thread, unless the caller waits for it: the yielding hook of
    :func:`_yield_now_and_then` is on (it was removed while the caller waited)."""
    if (
        threading.current_thread() is _WORKER._thread
        and not _WORKER.awaited
        and sys.getprofile() is not _yield_now_and_then
    ):
        sys.setprofile(_yield_now_and_then)


class _Worker:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[weakref.ref[Upgradable]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        self._pending = 0
        self._thread: threading.Thread | None = None
        self.closing = False
        self.threads = 1
        """The intra-op thread count of the caller that submitted last."""
        self.awaited = 0
        """How many callers wait for the compile thread now (:func:`awaited`)."""

    def submit(self, program: Upgradable) -> bool:
        threads = own_threads()
        with self._lock:
            if self.closing:
                return False
            self.threads = threads  # the caller's: the compile thread's kernels are made for it
            self._pending += 1
            self._queue.put(weakref.ref(program))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="phi_torch_jit compile", daemon=True
                )
                self._thread.start()
        return True

    def _run(self) -> None:
        while True:
            try:
                ref = self._queue.get(timeout=_IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():  # a submit under the lock restarts a thread
                        self._thread = None
                        return
                continue
            program = ref()
            try:
                if program is not None and not self.closing:
                    if torch.get_num_threads() != self.threads:  # NOTE [a core for the compile]
                        torch.set_num_threads(self.threads)
                    rehooked()  # this thread only
                    with taken():
                        program.upgrade()
            except Abandoned:  # at exit: the program stays on its fast tier
                pass
            finally:
                del program
                with self._lock:
                    self._pending -= 1
                    self._settled.notify_all()

    def wait_idle(self, timeout: float | None) -> bool:
        with self._lock:
            return self._settled.wait_for(lambda: self._pending == 0, timeout)

    def alive(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def close(self) -> None:
        """At interpreter exit: no new compile starts, and a running one is stopped (raised
        into at its next Python call, :func:`_yield_now_and_then`); wait ``EXIT_WAIT_S`` at
        most for it to unwind. Left running inside torch while the interpreter shut down, a
        compile aborted the process ("terminate called without an active exception", exit
        code 134)."""
        with self._lock:
            self.closing = True
            self._settled.wait_for(lambda: self._pending == 0, EXIT_WAIT_S)


_WORKER = _Worker()
atexit.register(_WORKER.close)


@contextlib.contextmanager
def awaited() -> Iterator[None]:
    """Around a wait of the caller for a warm start's loads on the compile thread: they run
    without handing the GIL back meanwhile (:func:`_yield_now_and_then`)."""
    with _WORKER._lock:
        _WORKER.awaited += 1
    try:
        yield
    finally:
        with _WORKER._lock:
            _WORKER.awaited -= 1


def submit(program: Upgradable) -> bool:
    """Queue ``program.upgrade()`` on the compile thread; False at interpreter exit."""
    return _WORKER.submit(program)


def wait_idle(timeout: float | None = None) -> bool:
    """Wait until every queued compile has finished; False if ``timeout`` s passed first."""
    return _WORKER.wait_idle(timeout)


def worker_alive() -> bool:
    """Whether the compile thread runs now (it ends after a second without jobs)."""
    return _WORKER.alive()


def exiting() -> bool:
    """Whether the interpreter is shutting down: the main thread has ended. A compile still
    running then fails (inductor's worker pool is shut down before ``atexit`` hooks run:
    "cannot schedule new futures after interpreter shutdown"); that is no failure to report."""
    return not threading.main_thread().is_alive()
