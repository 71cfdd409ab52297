"""The worker process of :mod:`._compile_process`: compiles captured graphs into inductor's
on-disk caches for the process that started it.

Started as ``python -c`` by that process, with its ``sys.path`` (JSON) as an argument. Each
request is a length (8 bytes, little-endian) and a pickled dict: ``target`` (a ``Compilable``),
``settings`` (inductor's and AOTAutograd's, from ``_compat.process_compile_settings``),
``cache_dir`` (inductor's cache directory there), ``threads`` (torch's intra-op threads there:
inductor's CPU kernels are generated for them), ``ops`` (the contracts of the custom-function
ops the graph calls, ``_op_contracts``: defined here as stand-ins) and the graph. Each reply, on
stdout, is a pickled dict: ``error`` None, or why the compile failed. Before it, a compile may
ask the caller which gradients of one of its ops are present: ``{"ask": (name, pattern, saved,
grad_outputs)}``, answered on stdin (length-prefixed like a request) by ``{"present": ...}`` or
``{"error": ...}``. The compiled program itself stays here: only inductor's caches carry it
back.

Once its imports are done it says so on stdout (``{"ready": True}``, before any reply): until
then it uses a core (NOTE [a core for the compile]). Stdin and stdout carry nothing else: the
process's own file descriptors 0 and 1 are pointed elsewhere at start (inductor's C++
compiler writes to them). It ends when its stdin closes (the caller's process ended), on a
request it cannot read, or after ``idle_exit_s`` without one. It runs at a lower CPU priority
(:data:`NICE`) than the caller.
"""

from __future__ import annotations

import os
import pickle
import select
import sys
import traceback
from typing import Any, BinaryIO

__all__ = ["serve", "NICE", "NICE_ENV", "nice_increment"]

NICE = 10
"""How much lower the worker's CPU priority is than its caller's (POSIX ``nice``), unless
:data:`NICE_ENV` says otherwise."""
NICE_ENV = "PHI_TORCH_JIT_COMPILE_NICE"
"""An integer from 0 to 19 to use instead of :data:`NICE`: 0 where CPU-bound jobs of equal
priority fill the cores and a lowered compile would starve (the test suite sets it: beside two
busy processes on two cores, an inductor compile at +10 took over 300 s)."""


def nice_increment() -> int:
    """:data:`NICE`, or the value of :data:`NICE_ENV`; ValueError naming it if not 0-19."""
    raw = os.environ.get(NICE_ENV, "").strip()
    if not raw:
        return NICE
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= 19:
        raise ValueError(f"{NICE_ENV}={raw!r}: expected an integer from 0 to 19 (default {NICE})")
    return value


def serve(idle_exit_s: float, nice: int = NICE) -> None:
    """Answer requests until stdin closes or ``idle_exit_s`` pass without one, ``nice``
    lower in CPU priority than the caller."""
    requests = os.fdopen(os.dup(0), "rb", buffering=0)
    replies = os.fdopen(os.dup(1), "wb")
    quiet = os.open(os.devnull, os.O_RDWR)
    os.dup2(quiet, 0)
    os.dup2(2, 1)  # print() and the C++ compiler's output go where stderr goes
    sys.stdout = sys.stderr
    if hasattr(os, "nice") and nice:
        os.nice(nice)
    from .._compat import import_inductor

    import_inductor()  # before the first request: the caller may start this one early
    _send(replies, {"ready": True})  # the caller's steps may use every core again
    while True:
        ready, _, _ = select.select([requests], [], [], idle_exit_s)
        if not ready:
            return
        request = _read(requests)
        if request is None:
            return
        _send(replies, {"error": _compile(request, _Asking(requests, replies))})


def _send(stream: BinaryIO, message: dict[str, Any]) -> None:
    pickle.dump(message, stream)
    stream.flush()


class _Asking:
    """Asks the caller a compile's question about one of its ops (which gradients of a
    custom function are present, ``_op_contracts``) while the compile waits."""

    def __init__(self, requests: BinaryIO, replies: BinaryIO) -> None:
        self.requests = requests
        self.replies = replies

    def __call__(self, name: str, *question: Any) -> tuple[bool, ...]:
        _send(self.replies, {"ask": (name, *question)})
        answer = _read(self.requests)
        if answer is None:
            raise EOFError("the caller's process ended")
        reply: dict[str, Any] = pickle.loads(answer)
        if reply.get("error") is not None:
            raise RuntimeError(f"the caller could not answer for the op {name}: {reply['error']}")
        return tuple(reply["present"])


def _read(stream: BinaryIO) -> bytes | None:
    header = _read_exactly(stream, 8)
    return None if header is None else _read_exactly(stream, int.from_bytes(header, "little"))


def _read_exactly(stream: BinaryIO, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _compile(pickled: bytes, ask: _Asking) -> str | None:
    """Compile one request's target into the caches; None, or why it failed."""
    try:
        import torch

        from .._compat import adopt_compile_settings
        from ._graph_pickle import graph_from
        from ._op_contracts import stand_ins

        request: dict[str, Any] = pickle.loads(pickled)
        stand_ins(request.get("ops", ()), ask)  # before the graph: its nodes name them
        target = request["target"]
        target.graph = graph_from(request["graph"])
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = request["cache_dir"]
        adopt_compile_settings(request["settings"])
        torch.set_num_threads(request["threads"])
        target.compile()
    except Exception:  # reported to the caller, which then compiles in its own process
        return traceback.format_exc(limit=8)
    return None
