"""A Python callable recorded as one op of a captured graph.

``make_fx`` records the ATen ops a function runs; a call that must stay Python inside the graph
(a library's solver, whose loop runs as compiled blocks of its own, ``adapters.phiml``) is made
through :func:`call`: the op ``phi_torch_jit::opaque_call(int key, Tensor[] args) -> Tensor[]``,
whose implementation calls the callable registered under ``key``. The graph holds the key as a
constant, so it runs only in this process: it is served as captured (straight-line), never
handed to a compile in a worker process or cached on disk.

The callable gets copies of its tensor arguments (it may write them in place: a CG updates its
initial guess), except the leading ones it was registered as only reading (a matrix's parts),
and its outputs never alias them. A key lives as long as the object it was registered for;
keys registered during a capture (:func:`collected`) are released when the capture ends, or
live as long as the captured program that :func:`keep` gives them to.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from .._compat import unaliased
from ._op_contracts import NAMESPACE

__all__ = ["register", "call", "collected", "keep", "reads_of", "OP_NAME"]

OP_NAME = "opaque_call"

_CALLABLES: dict[int, tuple[Callable[..., Sequence[torch.Tensor]], int]] = {}
_KEYS = itertools.count()
_LOCK = threading.Lock()
_LIBRARY: list[Any] = []


def _define() -> Any:
    """The op, defined once per process."""
    with _LOCK:
        if not _LIBRARY:
            library = torch.library.Library(NAMESPACE, "FRAGMENT")
            library.define(f"{OP_NAME}(int key, Tensor[] args) -> Tensor[]")
            library.impl(OP_NAME, _impl, "CompositeExplicitAutograd")
            _LIBRARY.append(library)
    return getattr(getattr(torch.ops, NAMESPACE), OP_NAME).default


def _impl(key: int, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    registered = _CALLABLES.get(key)
    if registered is None:
        raise RuntimeError(f"phi_torch_jit: opaque call {key} was released with its owner")
    function, reads = registered
    passed = [*args[:reads], *(a.clone() for a in args[reads:])]
    return unaliased(list(function(*passed)), args)


def register(function: Callable[..., Sequence[torch.Tensor]], owner: Any, reads: int = 0) -> int:
    """A key that :func:`call` runs ``function`` under, released when ``owner`` is collected
    (or at the end of a :func:`collected` block that does not keep it). Its first ``reads``
    arguments are passed as they are (it must not write them), the others as copies."""
    key = next(_KEYS)
    _CALLABLES[key] = (function, reads)
    weakref.finalize(owner, _CALLABLES.pop, key, None)
    collecting = _COLLECTING.get()
    if collecting is not None:
        collecting.append(key)
    return key


def reads_of(key: int) -> int:
    """How many leading arguments the callable under ``key`` only reads (0: released)."""
    registered = _CALLABLES.get(key)
    return registered[1] if registered is not None else 0


_COLLECTING: ContextVar[list[int] | None] = ContextVar("phi_torch_jit_opaque", default=None)


@contextmanager
def collected() -> Iterator[list[int]]:
    """The keys registered on this thread while the block runs (a capture's ops): released
    at its end, unless :func:`keep` gave them to the program that calls them."""
    keys: list[int] = []
    token = _COLLECTING.set(keys)
    try:
        yield keys
    finally:
        _COLLECTING.reset(token)
        for key in keys:
            _CALLABLES.pop(key, None)


def keep(keys: list[int], owner: Any) -> None:
    """The callables under ``keys`` live as long as ``owner`` (the captured program)."""
    for key in keys:
        if key in _CALLABLES:
            weakref.finalize(owner, _CALLABLES.pop, key, None)
    keys.clear()


def call(key: int, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Runs the callable registered under ``key`` as one op (one node under ``make_fx``)."""
    return tuple(_define()(key, list(tensors)))
