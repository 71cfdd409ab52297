"""Tensor-to-Python reads (``bool(t)``, ``t.item()``, ``t.tolist()``...), patched once for all.

Two stages watch these reads: the value guards of the trace phase record the ones user code
makes (:mod:`._value_guards`), and the capture of a custom function's body refuses the ones
that read memory past make_fx (:mod:`.engines._graph_bodies`). Each used to replace the same
methods of ``torch.Tensor`` with its own, and to put back what it had found when it was done:
two threads using them at once put back each other's replacement, or removed it twice (a read
raised "type object 'Tensor' has no attribute 'tolist'"; found by two threads jitting at
once). Now one patch is installed while any watcher is active; each read asks the watchers in
turn, and the first that answers (a value, or an exception) decides; if none does, torch reads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ._compat import tensor_conversion
from ._patches import TensorAttributes

__all__ = ["READS", "PASS", "Watcher", "watching"]

READS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy")
"""The reads watched; ``numpy`` also serves ``np.asarray(t)`` (``Tensor.__array__`` calls it)."""

PASS = object()
"""What a watcher returns to leave a read to the next watcher (and finally to torch)."""

Watcher = Callable[[str, torch.Tensor, tuple[Any, ...], Callable[..., Any]], Any]
"""``watcher(kind, tensor, args, read)``: the value of the read (``read(tensor, *args)`` is
torch's), or :data:`PASS`; it may raise."""

_WATCHERS: tuple[Watcher, ...] = ()
_LOCK = threading.Lock()


def _patched(kind: str) -> Callable[..., Any]:
    read = tensor_conversion(kind)

    def watched(self: torch.Tensor, *args: Any) -> Any:
        for watcher in _WATCHERS:
            value = watcher(kind, self, args, read)
            if value is not PASS:
                return value
        return read(self, *args)

    watched.__name__ = kind
    return watched


_PATCH = TensorAttributes(READS, _patched)


@contextmanager
def watching(watcher: Watcher) -> Iterator[None]:
    """Ask ``watcher`` about every read while the block runs (any thread's reads)."""
    global _WATCHERS
    with _LOCK:
        if not _WATCHERS:
            _PATCH.install()
        _WATCHERS = (*_WATCHERS, watcher)
    try:
        yield
    finally:
        with _LOCK:
            left = list(_WATCHERS)
            left.remove(watcher)
            _WATCHERS = tuple(left)
            if not _WATCHERS:
                _PATCH.remove()
