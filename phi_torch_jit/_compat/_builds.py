"""Inductor's C++ builds, run inside a context the package chooses (:func:`around_cpp_builds`).

A CPU compile by inductor spends 40-55% of its time in the C++ compiler, a subprocess during
which the compiling thread waits and traces nothing (measured: a PhiFlow heat step's compile
15.5 of 25.2 s, bench-peers (a) 14.1 of 27.7 s, all on the compiling thread). Engine "auto"
lends its tracing lock for that time (``engines._tracing_lock``), so that a caller's capture
can run instead of waiting for the whole compile.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Callable
from typing import Any

from ._private import CPP_BUILD

__all__ = ["around_cpp_builds", "wrap_cpp_builds"]

_HOOK: list[Callable[[], contextlib.AbstractContextManager[Any]]] = [contextlib.nullcontext]
_WRAPPED: list[bool] = []
_LOCK = threading.Lock()


def around_cpp_builds(hook: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
    """Run each of inductor's C++ compiler subprocesses inside ``hook()`` from now on (one hook
    per process; the last one set wins). Cheap: inductor is wrapped at its first compile
    (:func:`wrap_cpp_builds`), not imported here."""
    _HOOK[0] = hook


def wrap_cpp_builds() -> None:
    """Wrap inductor's C++ compiler call, once per process (imports inductor's builder)."""
    with _LOCK:
        if _WRAPPED:
            return
        original = CPP_BUILD.find()
        module = importlib.import_module(original.__module__)

        def build(cmd_line: str, cwd: str) -> None:
            with _HOOK[0]():
                original(cmd_line, cwd)

        build.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(module, original.__name__, build)
        _WRAPPED.append(True)
