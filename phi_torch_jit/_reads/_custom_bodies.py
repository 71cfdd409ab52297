"""Stage 1 (reads): tensors the body of a custom function reads from Python state.

A global or closure tensor the step reads is an *input* of the compiled program: its
metadata is guarded, and the tensor the name holds at each call is passed in, so a tensor
rebound between calls (``W = torch.tensor(-4.0)``) is used. A custom function's forward and
backward are compiled apart (``_custom_op``): a tensor their code reads from a global, a
closure, a class attribute or an attribute path is a *constant* of that compiled body, the
object it was when captured. An update in place is seen (the constant is that object); a
rebinding was not: the program kept computing with the old tensor, output and gradient
(found by a probe). Such reads are therefore guarded by identity too: a rebinding retraces,
and the new trace captures the body with the new tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._code_walk import names_read
from ._reachable import user_functions
from ._records import Kind, Read, Step

__all__ = ["roots_read_by", "held_by_identity"]


def roots_read_by(callables: Sequence[Any]) -> set[Any]:
    """The keys (as :func:`._python.collect_reads` keys its reads: ``(id(globals), name)``
    for a global, ``id(cell)`` for a closure variable) of the globals and closure variables
    that the code reachable from ``callables`` reads."""
    roots: set[Any] = set()
    for function in user_functions(list(callables)):
        code = function.__code__
        globals_read, cells_read = names_read(code)
        namespace = function.__globals__
        roots.update((id(namespace), name) for name in globals_read if name in namespace)
        for name, cell in zip(code.co_freevars, function.__closure__ or ()):
            if name in cells_read:
                roots.add(id(cell))
    return roots


def held_by_identity(reads: dict[Any, Read], roots: set[Any]) -> None:
    """Add an identity read beside each tensor read under one of ``roots``."""
    for key, read in list(reads.items()):
        if read.kind is Kind.TENSOR and _root(key) in roots:
            try:
                value = read.source.get()
            except Exception:  # gone since: the tensor read's guard fails on its own
                continue
            reads[(key, "object")] = Read(read.source, Kind.IDENTITY, value)


def _root(key: Any) -> Any:
    """The global's or cell's key an attribute path's key starts from."""
    while isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], Step):
        key = key[0]
    return key
