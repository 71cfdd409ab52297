"""Stage 1 (reads): how a container of plain values that the function read is compared.

A list, dict, set, tuple, deque or ``array`` of immutable values (numbers, strings, tuples of
them), nested, is guarded by its content: a copy taken when traced (:func:`snapshot`),
compared in a canonical form (:func:`strict`), so that what ``==`` calls equal but a program
may not treat alike retraces: ``2`` and ``2.0`` (a dtype, an ``isinstance`` branch), ``-0.0``
and ``0.0``, ``1`` and ``True``, a dict's or set's order (a loop over ``d.values()``).
"""

from __future__ import annotations

import array
import collections
import copy
import ctypes
import mmap
import types
from typing import Any

from ._records import Kind, Step, immutable

__all__ = ["MAX_CONTENT", "plain_container", "snapshot", "strict", "buffer_read",
           "SIZED"]  # fmt: skip

MAX_CONTENT = 4096
"""Containers of immutable values up to this many items (recursively, keys counted) are
guarded by content, in canonical form (``marshal``: 44 us for 4096 floats here, against 3 us
for ``==``; until session 41 contents of more than 256 items were compared by ``==``, and a
dict of 300 entries reordered, or ``L[0] = 0.0`` in a list of 300 ints, kept the first
program: probe 47); larger ones by identity and their entries."""

SIZED = (list, dict, set, collections.deque, types.MappingProxyType)
"""Containers guarded by identity whose length is guarded too: an append retraces (a
``deque(maxlen=3)`` of tensors growing: probe round 19)."""

_MAPPINGS = (dict, collections.OrderedDict, collections.defaultdict, collections.Counter)
_SEQUENCES = (list, set, tuple, collections.deque, array.array, bytearray)


def plain_container(value: Any, limit: int = MAX_CONTENT) -> bool:
    try:
        return _small_plain(value, limit) >= 0
    except Exception:  # a container's own rules (a __len__ that raises)
        return False


def _small_plain(value: Any, budget: int) -> int:
    """Budget left after walking a list/dict/set/deque/array of immutable values (also an
    OrderedDict, a defaultdict, a Counter); -1 if it is not one."""
    if immutable(value):
        return budget - 1
    if type(value) is collections.defaultdict and value.default_factory is not None:
        return -1  # a defaultdict's factory is state too (probe 53a): walked, by identity
    if type(value) in _MAPPINGS:
        items = [*value.keys(), *value.values()]
    elif type(value) in _SEQUENCES:
        if len(value) > budget:
            return -1
        items = list(value)
    else:  # a library's subclass of tuple or dict (e3nn's Irreps): its own semantics
        return -1
    for item in items:
        budget = _small_plain(item, budget)
        if budget < 0:
            return -1
    return budget


def strict(kind: Kind, value: Any) -> bool:
    """Whether ``value`` is compared in its canonical form (``_records.canonical``): a zero
    float (``-0.0`` equals ``0.0``; other floats are equal only to themselves) and containers
    of plain values, all that are guarded by content (``[2]`` vs ``[2.0]``, a dict's order)."""
    if kind is Kind.VALUE:
        if type(value) is complex:
            return value.real == 0 or value.imag == 0
        if type(value) in (tuple, frozenset):  # (2,) == (2.0,); not a tuple of classes
            return len(value) <= MAX_CONTENT and all(map(immutable, value))  # (their reprs)
        return isinstance(value, float) and value == 0  # np.float64 too (compared by repr)
    return kind is Kind.CONTENT


def snapshot(value: Any) -> Any:
    if type(value) not in (list, dict, set, tuple):  # an OrderedDict, a deque (its maxlen)
        return copy.deepcopy(value)
    if type(value) is list:
        return [snapshot(v) for v in value]
    if type(value) is dict:
        return {k: snapshot(v) for k, v in value.items()}
    if type(value) is set:
        return set(value)
    if type(value) is tuple:  # immutable, but its lists may not be (a partial's arguments)
        return tuple(snapshot(v) for v in value)
    return value


MAX_BUFFER = 1 << 16
"""A ``memoryview`` or an ``mmap`` of up to this many bytes is guarded by what it holds."""
_TOBYTES = Step(True, "tobytes", call=True)
_BYTES = Step(False, "bytes", text=True)


_CTYPES_DATA = (ctypes.Array, ctypes.Structure, ctypes.Union)


def buffer_read(value: Any) -> Step | None:
    """The step reading what a small buffer holds now (a ``memoryview``'s ``tobytes()``, an
    open ``mmap``'s ``bytes()``: ``struct.unpack_from("d", MM)`` reads it; a ``ctypes``
    array's or structure's ``bytes()``: ``for c in CA`` or ``sum(CA)`` reads it whole, probe
    41c), or None."""
    try:
        if isinstance(value, memoryview) and value.nbytes <= MAX_BUFFER:
            return _TOBYTES
        if isinstance(value, mmap.mmap) and len(value) <= MAX_BUFFER:
            return _BYTES
        if isinstance(value, _CTYPES_DATA) and ctypes.sizeof(value) <= MAX_BUFFER:
            return _BYTES
    except ValueError:  # released, closed
        return None
    return None
