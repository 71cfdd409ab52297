"""A core left to our background work: while a compile of ours runs beside the caller (on
the compile thread, in the worker process, or while that process starts), the programs
engine "auto" serves run torch's intra-op work on one thread fewer.

Why: torch's CPU ops split their work over OpenMP threads, one per core by default, and every
op ends when its last thread is done. Where one of those threads shares its core with our
compile, each op waits for the scheduler to give it back: a PhiFlow heat step (128x128, its
CG run by PhiML's loop on the fast tier) took 7.0 ms a step while the worker process started
and compiled beside it on this 2-core machine, 2.7 ms without the worker, and 3.2 ms with the
worker and one thread (NOTE [a core for the compile] in docs/design.md).

Only where the caller's threads fill every core this process may use (torch's default),
only on OpenMP builds (a native thread pool cannot change its size once used), and only
around our served programs: the record pass and the meter's eager samples run the user's
Python, which may read ``torch.get_num_threads()``, and so does code outside our calls.
Inductor's kernels were generated for a thread count and keep it; their ATen calls do not.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "busy",
    "taken",
    "take",
    "give_back",
    "with_fewer_threads",
    "all_threads",
    "own_threads",
    "HELD",
]


class _Held:
    __slots__ = ("cores",)

    def __init__(self) -> None:
        self.cores = 0
        """Background jobs of ours using a core now."""


HELD = _Held()
"""Read, not called, on a served call's path (:func:`busy` is the same test)."""
_lock = threading.Lock()
_local = threading.local()
"""``threads``: this thread's own count while a call runs on one fewer (else 0)."""
calls = 0
"""Calls run on one thread fewer (tests)."""


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


CORES = _cores()
"""Cores this process may run on."""
OPENMP = "parallel backend: OpenMP" in torch.__config__.parallel_info()
"""Whether torch's intra-op threads are OpenMP's, whose number can change between ops."""


def take() -> None:
    """Background work of ours starts using a core (pair with :func:`give_back`)."""
    with _lock:
        HELD.cores += 1


def give_back() -> None:
    with _lock:
        HELD.cores -= 1


@contextlib.contextmanager
def taken() -> Iterator[None]:
    """Around background work of ours that uses a core."""
    take()
    try:
        yield
    finally:
        give_back()


def _forked() -> None:
    """In a forked child: the parent's compile thread and worker are not its own."""
    global _lock
    _lock = threading.Lock()
    HELD.cores = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def busy() -> bool:
    """Whether background work of ours uses a core now."""
    return HELD.cores > 0


def with_fewer_threads(run: Callable[..., Any], *args: Any) -> Any:
    """``run(*args)``, on one intra-op thread fewer where torch's threads fill every core and
    background work of ours uses one (:func:`busy`); the count is set back after, unless
    ``run`` changed it."""
    global calls
    threads = torch.get_num_threads()
    if not (HELD.cores and OPENMP and 1 < threads and threads >= CORES):
        return run(*args)
    torch.set_num_threads(threads - 1)
    calls += 1
    _local.threads = threads
    try:
        return run(*args)
    finally:
        _local.threads = 0
        if torch.get_num_threads() == threads - 1:
            torch.set_num_threads(threads)


def own_threads() -> int:
    """This thread's intra-op thread count as the user set it (inside a call on one thread
    fewer: the count before it). A thread takes torch's process-wide count, which
    ``torch.set_num_threads`` also sets, at its first op: one started inside such a call
    takes one fewer, so the compile thread sets its own from this (:mod:`._background`)."""
    return getattr(_local, "threads", 0) or torch.get_num_threads()


@contextlib.contextmanager
def all_threads() -> Iterator[None]:
    """Around a compile on this thread: inductor makes its CPU kernels for the thread count it
    sees, and keys its caches by it, so a compile inside a call on one thread fewer (a loop's
    block met with new inputs) sees the caller's own count."""
    threads = getattr(_local, "threads", 0)
    if not threads or torch.get_num_threads() != threads - 1:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(threads - 1)
