"""The specialization cache of one jitted function: lookup, LRU order, eviction.

Keys are ``(argument spec, grad mode)``; each key holds its specializations newest first
(they differ in module state or value-guarded branches). Readers never take the lock: they get
an immutable tuple, and every mutation -- insert, LRU touch, eviction, clear -- replaces
tuples under the lock. A call that misses builds under :attr:`SpecializationCache.lock` and
first serves from what other threads added meanwhile (double-checked), so two threads never
build the same specialization, and a reader can never see an entry list being evicted.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator

from ._specialization import Key, Specialization

__all__ = ["SpecializationCache", "clear_caches"]


class SpecializationCache:
    """At most ``max_size`` specializations, least recently used keys evicted first."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        """How many specializations are kept (all keys together)."""
        self.lock = threading.RLock()
        """Held while a specialization is built and for every mutation."""
        self._entries: OrderedDict[Key, tuple[Specialization, ...]] = OrderedDict()
        _LIVE.add(self)

    def lookup(self, key: Key) -> tuple[Specialization, ...]:
        """The specializations cached under ``key``, newest first (no lock taken)."""
        return self._entries.get(key, ())

    def touch(self, key: Key) -> None:
        """Mark ``key`` as the most recently used."""
        if len(self._entries) > 1 and next(reversed(self._entries)) is not key:  # not newest
            with self.lock:
                if key in self._entries:
                    self._entries.move_to_end(key)

    def insert(self, specialization: Specialization) -> list[Specialization]:
        """Add a specialization as the newest of its key; return the ones evicted for it."""
        key = specialization.key
        with self.lock:
            self._entries[key] = (specialization, *self._entries.get(key, ()))
            self._entries.move_to_end(key)
            return self._evict()

    def replace(self, specialization: Specialization) -> None:
        """Make a specialization the only one of its key (the others are closed)."""
        with self.lock:
            dropped = list(self._entries.get(specialization.key, ()))
            self._entries[specialization.key] = (specialization,)
            self._entries.move_to_end(specialization.key)
        _close(dropped)

    def _evict(self) -> list[Specialization]:
        evicted = []
        while len(self) > self.max_size:
            key, entries = next(iter(self._entries.items()))
            evicted.append(entries[-1])  # the oldest of the least recently used key
            if len(entries) > 1:
                self._entries[key] = entries[:-1]
            else:
                del self._entries[key]
        _close(evicted)
        return evicted

    def clear(self) -> None:
        """Drop every specialization (and the tensors and ops they hold)."""
        with self.lock:
            dropped = list(self)
            self._entries.clear()
        _close(dropped)

    def __len__(self) -> int:
        return sum(map(len, list(self._entries.values())))

    def __iter__(self) -> Iterator[Specialization]:
        """Every specialization, least recently used key first, newest first per key."""
        for entries in list(self._entries.values()):
            yield from entries


def _close(dropped: list[Specialization]) -> None:
    """Tell the engine that these left the cache (engine "auto": their compile is skipped)."""
    for specialization in dropped:
        if specialization.close_engine is not None:
            specialization.close_engine()


_LIVE: weakref.WeakSet[SpecializationCache] = weakref.WeakSet()


def clear_caches() -> None:
    """Drop the compiled specializations of every jitted function (frees their memory)."""
    for cache in list(_LIVE):
        cache.clear()
