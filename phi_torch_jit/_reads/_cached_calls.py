"""Stage 1 (reads), cached calls: what the caches of ``functools.lru_cache`` and
``functools.cache`` functions that the step calls hold.

The walk guards what a cached function reads (it follows the wrapper's ``__wrapped__``), but a
cache hit returns what the function computed from that state when the entry was filled, maybe
long before the trace. Two more things decide what a call of the wrapper returns: which
entries its cache holds (``cache_clear()`` empties it, and the next call computes anew from
the state now) and what the results it holds hold now (``table()[0] = 5.0`` changes the list
the cache hands out). Both were baked silently (probe: a cleared cache kept the traced value).

So each wrapper the walk reads (a global, a closure variable, a method of a class of yours, an
attribute or an item) has its cache guarded as ``cache_info()`` tells it, read once per guard
check: ``misses`` and ``currsize`` unchanged (an entry added, evicted or cleared), and no check
having seen ``hits`` or ``misses`` below what they were when the guard was built
(``cache_clear()`` resets both; once seen, the program stays refused, whatever the counts do
later: the step's own retraces refill the cache). Hits are not compared for equality: every
eager call of the step (a record pass, a call served eagerly) adds one, and compiled calls do
not call the wrapper at all, so a step calling it on every call does not retrace. And the
record pass runs with each wrapper found at a place that can be rebound (a global, a closure
cell, a class's or an object's ``__dict__``, a dict's entry, a list's item) replaced there by
an :class:`_Observer` that notes what it returns; each mutable result is guarded like a read
object (a list of numbers by content, an object of yours by its attributes; tensors in it by
identity, as constants of the program). See NOTE [cached calls] in docs/design.md.
"""

from __future__ import annotations

import functools
import threading
import types
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ._code_walk import user_function
from ._guard import PythonGuard
from ._held import describe_callable
from ._kinds import kind_of
from ._python import collect_reads
from ._records import GONE, Kind, Read, Source, Step, immutable, probe

__all__ = ["CachedCalls", "is_cache"]

_CACHE_TYPE = type(functools.lru_cache(maxsize=None)(len))
"""``functools._lru_cache_wrapper``: what ``lru_cache`` and ``cache`` return (C code)."""
MAX_RESULTS = 64
"""Distinct results guarded per cached function (what one record pass saw it return)."""
_LOCK = threading.Lock()


def is_cache(value: Any) -> bool:
    """Whether ``value`` is a function wrapped by ``functools.lru_cache`` or ``cache``."""
    return isinstance(value, _CACHE_TYPE)


def _yours(value: Any) -> bool:
    """Whether ``value`` is the cache of a function of yours (maybe under other decorators:
    ``@lru_cache`` over ``@torch.no_grad()``): a library's cache is the library's state, which
    its own calls change (its misses would retrace your step)."""
    if not is_cache(value):
        return False
    for _ in range(4):
        value = probe(value, "__wrapped__")
        function = getattr(value, "__func__", value)
        if isinstance(function, types.FunctionType) and user_function(function):
            return True
    return False


_TENSOR_KEYED = object()
"""Noted among a wrapper's results where a call passed it a tensor: its cache is keyed by the
tensor object, and hands out what it computed from the tensor's values then; a compiled
program computes from the values now, and a trace's stand-in for the tensor misses the
cache."""


class _Observer:
    """Stands in for a cached function during one record pass: calls it, and notes what it
    returns; everything else (``cache_info()``, ``__wrapped__``) is the wrapper's."""

    def __init__(self, wrapper: Any, results: list[Any]) -> None:
        self._wrapper = wrapper
        self._results = results

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self._wrapper(*args, **kwargs)
        results = self._results
        tensors = any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values()))
        if tensors and all(r is not _TENSOR_KEYED for r in results):  # (probe 38d)
            results.append(_TENSOR_KEYED)
        if len(results) < MAX_RESULTS and all(r is not result for r in results):
            results.append(result)
        return result

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        """A method: the wrapper bound to ``obj``, observed."""
        if obj is None:
            return self
        return _Observer(self._wrapper.__get__(obj, owner), self._results)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapper, name)


class CachedCalls:
    """The record pass's watch on cached functions, and the guards of their caches.

    ``with CachedCalls(reads):`` runs the record pass with the wrappers among ``reads`` (the
    side-effect snapshot's, taken before it) observed where they can be rebound;
    :meth:`guarded` then adds the guards, after the trace (which calls them again)."""

    def __init__(self, reads: Iterable[Read]) -> None:
        self._places: list[tuple[Source, Any, _Observer]] = []
        """Where a wrapper was found, the wrapper, its observer."""
        self._results: dict[int, list[Any]] = {}
        """What each wrapper (by id) returned in the record pass."""
        for read in reads:
            wrapper = read.expected
            if read.kind is Kind.IDENTITY and _yours(wrapper):
                results = self._results.setdefault(id(wrapper), [])
                self._places.append((read.source, wrapper, _Observer(wrapper, results)))
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> CachedCalls:
        with _LOCK:
            for source, wrapper, observer in self._places:
                place = _rebinding(source, wrapper)
                if place is not None:
                    place(observer)
                    self._undo.append(functools.partial(_restore, source, place, observer, wrapper))
        return self

    def __exit__(self, *exc: object) -> None:
        with _LOCK:
            for undo in reversed(self._undo):
                undo()
        self._undo = []

    def unrepeatable(self) -> list[str]:
        """Why the step runs eagerly for what the cached functions returned in the record
        pass: an iterator or a random generator (the step takes its next items, which a
        compiled program would not take: probe round 35 found the first item repeated)."""
        reasons = []
        for _, wrapper, _ in self._places:
            name = getattr(wrapper, "__qualname__", type(wrapper).__name__)
            if any(r is _TENSOR_KEYED for r in self._results.get(id(wrapper), [])):
                reasons.append(
                    f"{name}() is cached and was called with a tensor: its cache is keyed by "
                    "the tensor object and keeps what it computed from its values then, which "
                    "a compiled program would compute anew; pass the tensor's value in, or "
                    "call the function outside the jitted function, to have it compiled"
                )
                continue
            for result in self._results.get(id(wrapper), []):
                if kind_of(result) in (Kind.ITERATOR, Kind.DRAWS):
                    reasons.append(
                        f"{name}() returned a {type(result).__name__} object, whose next items "
                        "a compiled program would not take; pass the item in as an argument "
                        "to have it compiled"
                    )
                    break
        return list(dict.fromkeys(reasons))

    def guarded(self, guard: PythonGuard | None, used: set[int] | None) -> PythonGuard | None:
        """``guard`` with the state of the caches it reads a wrapper of, and what the record
        pass saw them return; ``used``: the tensors the program uses (``PythonGuard``'s)."""
        if guard is None:
            return None
        wrappers = {id(r.expected): r for r in guard.reads
                    if r.kind is Kind.IDENTITY and _yours(r.expected)}  # fmt: skip
        added: list[Read] = []
        for ident, read in wrappers.items():
            added += _cache_state(read.expected, read.source)
            added += _results_read(read.expected, self._results.get(ident, []))
        return PythonGuard([*guard.reads, *added], used) if added else guard


def _rebinding(source: Source, wrapper: Any) -> Callable[[Any], None] | None:
    """What rebinds the place ``source`` reads (which holds ``wrapper`` now), or None where
    it cannot be rebound without running code of the user's (a ``__setattr__``) or copying."""
    try:
        if source.get() is not wrapper:
            return None
        if not source.path:
            return None if source.namespace is None and source.cell is None else source.set
        last, owner = source.path[-1], source.above(-1).get()
    except GONE:
        return None
    if last.call or last.length or last.listed or last.text:
        return None
    if isinstance(owner, types.MappingProxyType) and source.path[-2:-1] == (_DICT,):
        owner = source.above(-2).get()  # K.__dict__["f"]: a method of a class
    elif last.attribute and not isinstance(owner, type):
        owner = probe(owner, "__dict__")  # an object's attribute, in its own dict
    if isinstance(owner, type) and isinstance(last.key, str) and last.key in vars(owner):
        return functools.partial(type.__setattr__, owner, last.key)
    if type(owner) is dict and owner.get(last.key) is wrapper:
        return functools.partial(owner.__setitem__, last.key)
    if type(owner) is list and type(last.key) is int and owner[last.key] is wrapper:
        return functools.partial(owner.__setitem__, last.key)  # OPS = [a, b]
    return None


_DICT = Step(True, "__dict__")


def _restore(source: Source, place: Callable[[Any], None], observer: Any, wrapper: Any) -> None:
    """Put ``wrapper`` back, unless the step rebound the place itself."""
    try:
        if source.get() is observer:
            place(wrapper)
    except GONE:
        return


class _CacheState:
    """What a guard check reads of ``wrapper``'s cache, from one ``cache_info()``: its
    ``misses`` and ``currsize``, and whether it was cleared since the trace, as the checks saw
    it: fewer hits or misses than then (``cache_clear()`` resets both), once seen, is kept.
    The same counts seen later do not bring the program back: the step's own retraces refill
    a cleared cache (another specialization's record and trace passes: one miss, one hit),
    and a program traced before the clear then passed a guard of the counts alone, serving
    what the cache held before (probe 38a)."""

    def __init__(self, wrapper: Any) -> None:
        info = wrapper.cache_info()
        self._wrapper, self._hits, self._misses = wrapper, info.hits, info.misses
        self._cleared = False

    def __call__(self) -> tuple[int, int | None, bool]:
        info = self._wrapper.cache_info()
        if not self._cleared:
            self._cleared = info.hits < self._hits or info.misses < self._misses
        return info.misses, info.currsize, self._cleared


_NOW = Step(True, "__call__", call=True)


def _cache_state(wrapper: Any, source: Source) -> list[Read]:
    """The read of ``wrapper``'s cache (:class:`_CacheState`): misses, size, cleared since."""
    state = _CacheState(wrapper)
    where = Source(f"{source.label}.cache_info() (misses, currsize, cleared since the trace)",
                   source.location, holder=state, path=(_NOW,))  # fmt: skip
    return [Read(where, Kind.VALUE, where.get())]


def _results_read(wrapper: Any, results: list[Any]) -> list[Read]:
    """What the record pass saw ``wrapper`` return, guarded like read objects: tensors by
    identity (constants of the program), modules by the module guard, immutable values by
    the cache's state (the same entry holds the same value)."""
    kept = [r for r in results if r is not _TENSOR_KEYED
            and not (immutable(r) or isinstance(r, (torch.Tensor, nn.Module)))]  # fmt: skip
    if not kept:
        return []
    name = getattr(wrapper, "__qualname__", type(wrapper).__name__)
    where = describe_callable(getattr(wrapper, "__wrapped__", wrapper))
    reads = collect_reads(None, (), kept, role=f"what {name}() returned")
    unique: dict[tuple[Any, ...], Read] = {}
    for read in reads:  # each result is a root twice (an argument, and an object held)
        unique.setdefault(_place(read.source), read)
    return [_as_held(r, where) for r in unique.values()]


def _place(source: Source) -> tuple[Any, ...]:
    return id(source.holder), id(source.namespace), source.name, id(source.cell), source.path


def _as_held(read: Read, where: str) -> Read:
    source = replace(read.source, location=where)
    if read.kind is not Kind.TENSOR:
        return replace(read, source=source)
    try:  # no input of the program: it was traced as a constant
        value = source.get()
    except GONE:  # gone already: the guard fails, as for any read gone
        value = None
    return Read(source, Kind.IDENTITY, value)
