"""Stage 1 (reads), past the walk's limits: what the record pass saw read of the rest.

The walk guards every field under a global or closure object, up to ``_MAX_FIELDS`` reads
per object and :data:`~._fields.TREE_DEPTH` levels (a guard is read before every call). A step
that reads item 250 of a list of 300 stage objects, an entry of a dict of 1000 by a computed
key, or node 40 of a linked list reads beyond them, and such a read was baked unguarded (a
logged warning; probe round 30).

So the rest of such an object (its *overflow*: the fields the walk did not reach) is indexed
when the walk stops there: which object lies where, by path from the global, up to
:data:`MAX_INDEXED` objects. Objects of classes of yours among them are watched in the next
record pass (their class's ``__getattribute__`` wrapped for the pass, as :mod:`._unread`
watches counters), and what that pass reads of them is guarded: each such object by identity
at its path, and each attribute read, by value or identity. The walk's overflow costs one more
record pass (the first call that meets it builds no specialization; the next call records
again, watching) and guards what the step reads, not what it could: the eager step itself
pays at least as much for those reads. What cannot be watched (a ``SimpleNamespace``'s
fields, a list's items, tensors in a list) is guarded as it is, up to :data:`MAX_LEAVES`
reads (a table of numbers compared whole); past that it stays unguarded, said in
``explain()`` and the log. See NOTE [past the walk's limits] in docs/design.md.
"""

from __future__ import annotations

import contextvars
import functools
import types
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from ._content import plain_container, snapshot
from ._fields import INSTANCE_DICT, fields, runs_code
from ._kinds import kind_of
from ._records import GONE, Kind, Read, Source, Step, probe
from ._unread import reads_watched, watchable

__all__ = ["Overflow", "overflowed", "MAX_INDEXED"]

MAX_INDEXED = 1 << 14
"""Objects indexed under one function's overflows at most (the index is built in each record
pass: 16384 objects take about 50 ms)."""
MAX_OBSERVED = 1 << 14
"""Attribute reads guarded from one record pass's watch at most (a guard of 16384 reads costs
about 1.5 ms here: a step reading that much of its state pays more itself)."""
MAX_LEAVES = 1 << 12
"""Reads of what cannot be watched past the walk's limits at most, per walk: the containers
(their identity and length), the values held directly in them, and the objects of classes
with a C base (a ``SimpleNamespace``) with their fields (4096 reads: about 0.35 ms a call)."""
MAX_COMPARED = 1 << 16
"""Items of a container of plain values compared whole (one ``==``: 46 us for a dict of 3000
one-number lists, where a read of each list took 263 us)."""

_CURRENT: contextvars.ContextVar[Overflow | None] = contextvars.ContextVar("overflow", default=None)


class Overflow:
    """Per jitted function: the objects past the walk's limits, by path, and which of their
    attributes the last watched record pass read."""

    def __init__(self) -> None:
        self._index: dict[int, tuple[Source, Any]] = {}
        """id -> (where, the object) of each object in the overflows the last walk met."""
        self._watched: dict[int, Any] = {}
        """The objects of watchable classes the next record pass watches (held)."""
        self._read: set[tuple[int, str]] = set()
        self._whole: set[int] = set()
        self._looked: dict[int, Any] = {}
        """The objects the last record pass watched."""
        self._again = False
        """Whether the last record pass was a look again (never two in a row)."""
        self._leaves: list[Source] = []
        """What cannot be watched there, guarded as it is (not walked under)."""
        self._compared: dict[Any, Read] = {}
        """Containers of plain values there, compared whole."""

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Run the record pass with the indexed objects' classes noting the attributes read."""
        self._read, self._whole, self._looked = set(), set(), dict(self._watched)
        with reads_watched(self._watched.values(), self._read, self._whole):
            yield

    @contextmanager
    def walking(self) -> Iterator[None]:
        """The walk of :func:`~._python.collect_reads`: its overflows are indexed anew."""
        self._index, self._leaves, self._compared = {}, [], {}
        token = _CURRENT.set(self)
        try:
            yield
        finally:
            _CURRENT.reset(token)
            self._watched = {i: v for i, (_, v) in self._index.items() if watchable(type(v))}

    def look_again(self) -> bool:
        """Whether the walk met objects past its limits that the record pass did not watch:
        then no specialization is built from it, and the next call records again, watching
        (never two record passes in a row)."""
        again = not self._again and any(i not in self._looked for i in self._watched)
        self._again = again
        return again

    def add_to(self, reads: dict[Any, Read], add: Callable[..., None]) -> None:
        """Add to ``reads`` what the last walk found past its limits: what cannot be watched,
        as it is; each watched object the pass read, at its path (walked whole where the pass
        read it whole, ``vars(obj)``), with its class (by identity: ``obj.__class__ = Other``;
        walked once per class: ``type(o).k``); each attribute read, not walked under. ``add``:
        the walk's ``_add(reads, key, source, budget)`` (a budget of ``[-1]``: no descent)."""
        reads.update(self._compared)
        for n, leaf in enumerate(self._leaves):
            add(reads, ("overflow leaf", n), leaf, [-1])
        read = sorted(p for p in self._read if p[0] in self._index)[:MAX_OBSERVED]
        for ident in sorted({i for i, _ in read} | (self._whole & set(self._index))):
            where, value = self._index[ident]
            add(reads, ("overflow", ident), where, None if ident in self._whole else [-1])
            klass = where.child(_CLASS)
            reads[("overflow class", ident)] = Read(klass, Kind.IDENTITY, type(value))
            add(reads, ("class", id(type(value))), klass, None)
        for ident, name in read:
            where, value = self._index[ident]
            if not name.startswith("__") and not runs_code(value, Step(True, name)):
                add(reads, ("overflow", ident, name), where.child(Step(True, name)), [-1])

    def index(self, source: Source, steps: list[Any]) -> bool:
        """Index the object at ``source`` and what ``steps`` and the steps below reach,
        breadth first (the shortest path to each), up to :data:`MAX_INDEXED`. Objects of
        watchable classes are left to the watch; what cannot be watched is kept as a leaf,
        guarded as it is (containers, what they hold directly, a ``SimpleNamespace`` and its
        fields), up to :data:`MAX_LEAVES`. Whether all of it is guarded: every watchable
        object watched in the record pass, and nothing left out."""
        pending: deque[tuple[Source, bool, list[Any] | None]] = deque([(source, False, steps)])
        seen, kept, compared = True, len(self._leaves), len(self._compared)
        while pending:
            where, held, under = pending.popleft()  # held: in what cannot be watched
            try:
                value = where.get()
            except GONE:
                continue
            kind = kind_of(value)
            if kind is Kind.IDENTITY and id(value) in self._index:  # met again (a registry's
                if not isinstance(value, _CODE):  # two keys, [row] * 30): here too, by identity
                    seen = self._same(where, value) and seen
                continue
            if kind is not Kind.IDENTITY:
                if held:
                    seen = self._leaf(where) and seen  # a value in a list, a namespace's field
                continue
            if len(self._index) >= MAX_INDEXED:
                seen = False
                break
            self._index[id(value)] = (where, value)
            if isinstance(value, _CODE):  # code, modules: walked apart
                continue
            if isinstance(value, _SIZED) and plain_container(value, MAX_COMPARED):
                read = Read(where, Kind.CONTENT, snapshot(value))  # a table of numbers: one
                self._compared[("overflow content", id(value))] = read  # ==, not a read each
                continue
            watched = watchable(type(value))
            plain = not isinstance(value, _SIZED) and plain_container(
                own := probe(value, "__dict__")
            )
            if not watched and plain and own:
                seen = self._leaf(where.child(INSTANCE_DICT)) and seen  # a namespace of
                continue  # plain values: its fields compared whole, one read
            seen = (self._leaf(where) if not watched else id(value) in self._looked) and seen
            try:
                under = fields(value) if under is None else under
            except Exception:  # an object's own __getattr__/__len__ rules: not walked
                continue
            pending.extend((_child(where, s), not watched, None) for s in under if _data(s))
            for step in under if not watched else ():  # a dict's order, a registry's size
                if not (_data(step) or _class_step(step)):
                    seen = self._leaf(_child(where, step)) and seen
        if not seen:  # said unguarded: no reads that guarantee nothing, each call
            del self._leaves[kept:]
            for key in list(self._compared)[compared:]:
                del self._compared[key]
        return seen

    def _leaf(self, where: Source) -> bool:
        if len(self._leaves) + len(self._compared) >= MAX_LEAVES:
            return False
        self._leaves.append(where)
        return True

    def _same(self, where: Source, value: Any) -> bool:
        if len(self._leaves) + len(self._compared) >= MAX_LEAVES:
            return False
        self._compared[("overflow place", len(self._compared))] = Read(where, Kind.IDENTITY, value)
        return True


_SIZED = (list, dict, set, tuple, deque)

_CODE = (type, types.ModuleType, types.FunctionType, types.MethodType,
         types.BuiltinFunctionType, nn.Module)  # fmt: skip
"""Objects whose state is guarded apart (code and modules by the walk, nn.Modules by the
module guard)."""


def _child(source: Source, step: Any) -> Source:
    return functools.reduce(Source.child, step if isinstance(step, tuple) else (step,), source)


_CLASS = Step(True, "__class__")


def _class_step(step: Any) -> bool:
    first = step[0] if isinstance(step, tuple) else step
    return bool(first.attribute and first.key in ("__class__", "__mro__"))


def _data(step: Any) -> bool:
    """A step to an attribute or an item (not to the class, nor to a listing of the keys)."""
    first, last = (step[0], step[-1]) if isinstance(step, tuple) else (step, step)
    if _class_step(step) or (first.attribute and first.key == "__dict__"):
        return False
    return not (last.listed or last.length or last.call or last.text)


def overflowed(source: Source, steps: list[Any]) -> bool:
    """Note that the walk stopped under ``source`` with ``steps`` left; whether the record
    pass watched all that lies there (then it is guarded as read, not said unguarded)."""
    overflow = _CURRENT.get()
    return overflow is not None and overflow.index(source, steps)
