"""Inductor's cold compiles of engine "auto" run in a worker process; the caller's process
then loads the program from inductor's caches.

A background compile on a thread of the caller's process shares the GIL with the caller:
inductor's compile is Python for most of its 10-90 s, and steps served meanwhile ran at
1.4-2.1x eager at the 90th percentile (bench_during_compile, 2026-11-28) even with the compile
thread yielding (``_background``). In a process of its own it takes no GIL from the caller.

How: :func:`compile_ahead`, called by the compile thread before it compiles, pickles the
compile's target (``Compilable``: the captured graph, its inputs' metadata, the grad mode,
the backend's settings) with inductor's and
AOTAutograd's settings and sends it to one long-lived worker process
(``engines._compile_worker``), which compiles it into inductor's on-disk caches, the same
directory as the caller's (``TORCHINDUCTOR_CACHE_DIR``). The compile thread waits for it
without holding the GIL or the tracing lock, then compiles the target itself: a load from the
caches (0.2-1 s) instead of the compile. The graph travels node for node
(``_graph_pickle``), and the compile thread compiles the graph rebuilt from the bytes it sent,
not the original: inductor's cache keys hash the module, and both processes then compile the
same one.

Sent there only: inductor compiles of CPU graphs of torch's own ops and of our custom functions'
ops (a library's ops would need registering there; ours are defined there as stand-ins from
their contracts, ``_op_contracts``, and the compile asks this process the one thing only the
user's code can say: which gradients are None), inductor's caches on, not known to be in them
already (a warm start loads at once), on POSIX systems, and not with
``PHI_TORCH_JIT_COMPILE_PROCESS=0``. Anything that goes wrong there (a graph that does not
pickle, a worker that cannot start or dies, a compile that fails) only means the compile thread
compiles in-process, as without a worker; at interpreter exit the worker is stopped and nothing
compiles in-process any more.

The worker starts when the first program whose compile goes there gets its fast tier
(:func:`start_worker_for`; importing torch and inductor takes 3-5 s, while the caller goes
on) and ends after :data:`IDLE_EXIT_S` without work, or when the caller's process ends (its
requests pipe closes). See NOTE [compiles in a worker process] in docs/design.md.
"""

from __future__ import annotations

import atexit
import copy
import functools
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from .._compat import inductor_cache_dir, inductor_caches_on, process_compile_settings
from ._compile_worker import nice_increment
from ._graph_pickle import graph_bytes, graph_from
from ._op_contracts import contracts_in, present
from ._spare_core import give_back, take
from ._warm_starts import CompileTarget, remembered

__all__ = [
    "ENV_SWITCH",
    "IDLE_EXIT_S",
    "ahead_of",
    "compile_ahead",
    "start_worker_for",
    "stop_worker",
    "worker_pid",
]

ENV_SWITCH = "PHI_TORCH_JIT_COMPILE_PROCESS"
"""Set to ``0`` to compile in the caller's process (on the compile thread) only."""

IDLE_EXIT_S = 60.0
"""How long the worker waits for its next compile before it ends."""

_logger = logging.getLogger("phi_torch_jit")


def compile_ahead(target: CompileTarget) -> bool:
    """Before the compile thread compiles ``target`` (a ``Compilable``): if it is one this
    module takes (:func:`_ours`), replace its graph by the graph as the worker will see it
    (rebuilt from the bytes sent, ``_graph_pickle``: inductor's cache keys hash a graph's
    module attributes, which a rebuilt one does not share with the original), then
    compile it in the worker unless inductor's caches hold it already (a warm start). Whether
    the worker compiled it: the compile thread's compile is then a load. Raises
    ``RuntimeError`` once the interpreter exits (no compile should start then)."""
    if not _ours(target):
        return False
    known = remembered(target)  # its fingerprint is the original graph's, kept on the target
    ops = contracts_in(target.graph)
    try:
        graph = graph_bytes(target.graph)
        as_sent = graph_from(graph)
        request = pickle.dumps(
            {
                "target": _without_graph(target),
                "graph": graph,
                "settings": process_compile_settings(),
                "cache_dir": inductor_cache_dir(),
                "threads": torch.get_num_threads(),  # inductor's CPU kernels are made for it
                "ops": ops,
            },
            protocol=pickle.HIGHEST_PROTOCOL,
        )
    except Exception as error:  # a graph constant that does not pickle: compile here
        _logger.debug("phi_torch_jit: a compile stays in-process (%s)", error)
        return False
    target.graph = as_sent
    return not known and _WORKER.compile(request)


def ahead_of(target: CompileTarget) -> Callable[[], bool]:
    """:func:`compile_ahead` of ``target``, to call later (a block of a captured loop); the
    worker is started now (:func:`start_worker_for`)."""
    start_worker_for(target)
    return functools.partial(compile_ahead, target)


def start_worker_for(target: CompileTarget) -> None:
    """Start the worker now if ``target``'s compile will go there (when a program's fast tier
    is built, two calls before its compile is queued): its 3-5 s of imports then overlap
    the first calls instead of delaying the compile. Never waits for the compile thread."""
    if _ours(target) and not remembered(target):
        _WORKER.start_soon()


def _ours(target: CompileTarget) -> bool:
    if os.environ.get(ENV_SWITCH, "1") == "0" or _WORKER.closed or os.name != "posix":
        return False  # the worker waits on its pipe with select(), which Windows lacks
    if target.backend != "inductor" or not inductor_caches_on():
        return False
    if any(torch.device(meta[3]).type != "cpu" for meta in target.metas):
        return False
    # a graph calling modules is not sent; one calling a library's ops needs them defined
    return contracts_in(target.graph) is not None


def _answer(name: str, *question: Any) -> dict[str, Any]:
    """The worker's question about the op ``name`` (which gradients are present), answered
    by the op of this process; an error (the worker's compile fails then) if it cannot be."""
    try:
        return {"present": present(name, *question)}
    except Exception as error:  # the op is gone, or the user's gradient raised: compile here
        return {"error": f"{type(error).__name__}: {error}"}


def _without_graph(target: CompileTarget) -> Any:
    shallow: Any = copy.copy(target)
    shallow.graph = None
    return shallow


def stop_worker() -> None:
    """Stop the worker process now, if it runs (tests; a new compile starts another)."""
    _WORKER.stop()


def worker_pid() -> int | None:
    """The worker process's id while it runs (tests)."""
    process = _WORKER.process
    return process.pid if process is not None and process.poll() is None else None


class _Worker:
    """The worker process, one at a time, one request at a time (the compile thread is the
    only caller; a lock keeps it so)."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.booted = threading.Event()
        """Set when the running process said its imports are done, or ended (set while
        there is none)."""
        self.booted.set()
        self.closed = False
        self.compiles = 0
        """Compiles the worker finished (tests)."""
        self._lock = threading.Lock()

    def compile(self, request: bytes) -> bool:
        with self._lock:
            if self.closed:
                raise RuntimeError("the interpreter is exiting: no compile starts")
            for _ in range(2):  # a worker that just ended idle: start a new one once
                process = self._running()
                if process is None:
                    return False
                self.booted.wait()  # its first message is read by _await_boot
                reply = self._exchange(process, request)
                if reply is not None:
                    break
                self._discard()
                if self.closed:
                    raise RuntimeError("the interpreter is exiting: the compile was stopped")
            else:
                return False
        if reply.get("error"):
            _logger.debug("phi_torch_jit: the worker's compile failed: %s", reply["error"])
            return False
        self.compiles += 1
        return True

    def start_soon(self) -> None:
        if self._lock.acquire(blocking=False):  # else the compile thread is using it
            try:
                if not self.closed:
                    self._running()
            finally:
                self._lock.release()

    def _running(self) -> subprocess.Popen[bytes] | None:
        if self.process is not None and self.process.poll() is None:
            return self.process
        self._discard()
        try:
            nice = str(nice_increment())
        except ValueError as error:  # a bad PHI_TORCH_JIT_COMPILE_NICE: said, and no worker
            _logger.warning("phi_torch_jit: no compile worker process: %s", error)
            return None
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _BOOT, repr(IDLE_EXIT_S), json.dumps(sys.path), nice],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                close_fds=True,
            )
        except (OSError, ValueError) as error:
            _logger.debug("phi_torch_jit: no compile worker process: %s", error)
            self._discard()
            return None
        self.booted = threading.Event()
        take()  # its imports use a core until it says they are done
        threading.Thread(
            target=_await_boot,
            args=(self.process, self.booted),
            name="phi_torch_jit worker boot",
            daemon=True,
        ).start()
        return self.process

    @staticmethod
    def _exchange(process: subprocess.Popen[bytes], request: bytes) -> dict[str, Any] | None:
        """Send one request and wait for its reply, answering the compile's questions about
        our ops meanwhile; None if the worker ended."""
        assert process.stdin is not None and process.stdout is not None
        try:
            while True:
                process.stdin.write(len(request).to_bytes(8, "little"))
                process.stdin.write(request)
                process.stdin.flush()
                reply = pickle.load(process.stdout)
                if not isinstance(reply, dict) or "ask" not in reply:
                    break
                request = pickle.dumps(_answer(*reply["ask"]), protocol=pickle.HIGHEST_PROTOCOL)
        except (OSError, EOFError, pickle.UnpicklingError) as error:
            _logger.debug("phi_torch_jit: the compile worker ended: %s", error)
            return None
        return reply if isinstance(reply, dict) else None

    def _discard(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        for stream in (process.stdin, process.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        if process.poll() is None:
            process.kill()
        process.wait()

    def forget_after_fork(self) -> None:
        """In a forked child: the worker and the lock are the parent's; start afresh."""
        self.process = None
        self._lock = threading.Lock()
        self.booted = threading.Event()
        self.booted.set()

    def stop(self) -> None:
        """Kill the worker; a compile thread waiting for its reply sees it end."""
        while not self._lock.acquire(timeout=0.05):  # the compile thread holds it: wake it
            process = self.process
            if process is not None and process.poll() is None:
                process.kill()
        try:
            self._discard()
        finally:
            self._lock.release()

    def close(self) -> None:
        """At interpreter exit: a compile running there is stopped (its thread's wait ends with
        an error, so that nothing compiles in-process while the interpreter shuts down)."""
        self.closed = True
        self.stop()


def _await_boot(process: subprocess.Popen[bytes], booted: threading.Event) -> None:
    """Read the worker's first message (its imports are done), or its end; then the core
    its imports used is given back."""
    try:
        assert process.stdout is not None
        pickle.load(process.stdout)
    except (OSError, EOFError, ValueError, pickle.UnpicklingError) as error:
        _logger.debug("phi_torch_jit: the compile worker ended while it started: %s", error)
    finally:
        give_back()
        booted.set()


_BOOT = (
    "import json, sys\n"
    "sys.path[:] = json.loads(sys.argv[2])\n"
    "from phi_torch_jit.engines._compile_worker import serve\n"
    "serve(float(sys.argv[1]), int(sys.argv[3]))\n"
)

_WORKER = _Worker()
atexit.register(_WORKER.close)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WORKER.forget_after_fork)
