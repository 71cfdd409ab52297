"""Stage 1 (record): Python state of the user's code that the function itself changes.

A compiled program runs no Python, so a step that advances a counter (``state["t"] += 1``),
appends to a history list, or counts its calls on a module (``self.calls += 1``) would stop
doing so once compiled; and since guards read the same state, it would retrace on every call,
each trace pass applying the change once more. :func:`snapshot` records, before the record
pass, the state a guard would read -- the globals and closure variables reachable user code
reads, their attribute paths (:mod:`._reads`), and the plain attributes of the modules known
before the call (arguments, modules read from globals and closures, a bound method's
``self``, and their submodules), and what the hooks of those modules and torch's global module
hooks read (a hook counting calls, or collecting activations, changes state on every call as
the step's own code does). :meth:`Snapshot.changes` says, after the record pass, what
the function changed. Such a specialization runs eagerly (its side effects then happen once
per call, as eagerly) with one warning that names the state: NOTE [side effects of the step].

Only user state counts: libraries' own caches (torch, PhiML, PhiFlow) are not walked.
"""

from __future__ import annotations

import array
import collections
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import WalkFailed
from ._code_walk import user_class
from ._content import SIZED
from ._hooks import hook_reads
from ._kinds import generator_of, generator_state
from ._python import collect_reads
from ._records import Kind, Read, array_copy, immutable, probe, same_value

__all__ = ["Snapshot", "snapshot", "modules_known_before", "Changing"]


def _fingerprint(read: Read) -> Any:
    """What a change of ``read`` shows in: its value, or for an object guarded by identity,
    the object and, for a container, its length (an append)."""
    value = read.source.get()
    if read.kind is Kind.DRAWS:  # a generator's state (a draw changes it); a clock's: none
        generator = generator_of(value)
        return None if generator is None else generator_state(generator)
    if read.kind in (Kind.ARRAY, Kind.IDENTITY) and _small_array(value):  # T[0] += 1: in place
        return array_copy(value)
    if read.kind is Kind.IDENTITY:
        return (id(value), len(value) if isinstance(value, SIZED) else None, _held_in_c(value))
    if read.kind is Kind.TENSOR:  # an input: in-place updates are seen; a rebind is not
        return _Identity(value)
    return read.current() if read.kind is not Kind.CONTENT else _copy(value)


def _held_in_c(value: Any) -> Any:
    """What a library object keeps in C shows of itself without changing it (probe 36a:
    ``Q.put(1)`` on a ``queue.SimpleQueue``, ``H.update(b)`` on a hash, ``C.value += 1`` on a
    ``ctypes`` value ran once per compile, silently): its bytes where it lends them (a
    ``ctypes`` value, an ``mmap``; up to 64 KiB), a queue's size, a hash's digest. None for
    the rest (their changes show in their length or attributes, or not at all)."""
    klass = type(value)
    if klass.__module__ in ("builtins", "numpy") or isinstance(value, torch.Tensor):
        return None  # containers: by length and content; arrays: copied
    if user_class(klass):  # walked by attribute; no code of yours runs here (a __getattr__)
        return None
    try:
        with memoryview(value) as view:
            shown = view.tobytes() if view.nbytes <= _MAX_VIEWED else None
        return (shown, _position(value)) if shown is not None else None
    except TypeError:
        pass
    try:
        if callable(getattr(klass, "qsize", None)):
            return ("qsize", value.qsize())
        if all(hasattr(klass, n) for n in ("digest", "update", "block_size")):
            return ("digest", value.digest())
    except Exception:  # a size the platform does not give (multiprocessing on macOS)
        return None
    return None


_MAX_VIEWED = 1 << 16


def _position(value: Any) -> Any:
    """Where a stream over the bytes reads next (an ``mmap``'s ``tell()``: ``MM.read(8)``
    moves it and leaves the bytes, probe 44b); None for what has none."""
    tell = getattr(value, "tell", None)
    if not callable(tell) or not callable(getattr(value, "seek", None)):
        return None
    try:
        return tell()
    except Exception:  # closed
        return None


_MAX_COPIED = 1 << 20
"""NumPy arrays up to this many elements are copied to see the function write them in place
(before and after each record pass); larger ones are compared by identity only."""


def _small_array(value: Any) -> bool:
    return hasattr(type(value), "__array_interface__") and getattr(value, "size", 0) <= _MAX_COPIED


class _Identity:
    """Equal to another only for the same object (held, so its id is not reused)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.value is self.value

    __hash__ = None  # type: ignore[assignment]


def _copy(value: Any) -> Any:
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, set):
        return set(value)
    if type(value) is tuple:  # immutable, its lists are not
        return tuple(_copy(v) for v in value)
    if isinstance(value, (collections.deque, array.array, bytearray)):  # popleft(): in place
        return copy.copy(value)  # (of immutable items: content reads hold no others)
    return value


def _module_attributes(modules: Sequence[nn.Module]) -> dict[tuple[int, str], Any]:
    """Plain immutable attributes by value; plain tensor attributes by identity
    (``self.total = self.total + err`` rebinds: no compiled program repeats it; a rebound
    *buffer* is written back into the original object, NOTE [side effects once])."""
    found: dict[tuple[int, str], Any] = {}
    for root in modules:
        for module in root.modules():
            label = type(module).__name__
            for name, value in vars(module).items():
                if name.startswith("_") or name == "training":
                    continue
                if immutable(value):
                    found[id(module), f"{label}.{name}"] = value
                elif isinstance(value, torch.Tensor):
                    found[id(module), f"{label}.{name}"] = _Identity(value)
    return found


@dataclass(frozen=True)
class Snapshot:
    """User state before the record pass."""

    reads: tuple[Read, ...]
    """What guards would read."""
    before: tuple[Any, ...]
    """Their fingerprints before the call."""
    modules: tuple[nn.Module, ...]
    """Modules known before the call."""
    attributes: dict[tuple[int, str], Any]
    """Their plain immutable attributes before the call."""

    def drawn(self) -> tuple[set[int], set[int]]:
        """The ids of the generators among the reads, and of those the call drew from (their
        state changed): one held but not drawn from (``self.rng`` used in ``__init__``) is
        no reason to run eagerly."""
        held, drawn = set(), set()
        for read, before in zip(self.reads, self.before):
            generator = generator_of(read.expected) if read.kind is Kind.DRAWS else None
            if generator is not None:
                held.add(id(generator))
                if _safe_fingerprint(read) != before:
                    drawn.add(id(generator))
        return held, drawn

    def changes(self) -> list[str]:
        """What the call changed, e.g. ``global state['t'] (read at f.py:3)``; draws aside
        (:meth:`drawn`)."""
        changed = []
        for read, before in zip(self.reads, self.before):
            if read.kind is Kind.DRAWS:
                continue
            try:
                now = _fingerprint(read)
            except Exception:  # gone, or a user object's attribute access raised
                now = "<gone>"
            if not same_value(now, before):
                changed.append(f"{read.source.label} (read at {read.source.location})")
        after = _module_attributes(self.modules)
        for key, value in self.attributes.items():
            if key not in after or not same_value(after[key], value):
                changed.append(f"module attribute {key[1]}")
        return changed


def snapshot(
    fn: Callable[..., Any], modules: Sequence[nn.Module], callables: Sequence[Any] = ()
) -> Snapshot:
    """The user state ``fn`` may change, before it runs (a static walk: no Python of ``fn``);
    ``callables``: objects passed as arguments whose state its call may change too (a loader
    object's counter)."""
    try:
        reads = tuple(collect_reads(fn, modules, callables))
        modules = tuple(modules_known_before(fn, reads, modules))
        reads += tuple(hook_reads([m for root in modules for m in root.modules()], reads))  # too
    except WalkFailed as failed:  # nothing ran yet: the caller runs the function eagerly
        raise WalkFailed(failed.reason, before_record=True) from failed
    return Snapshot(reads, tuple(map(_safe_fingerprint, reads)), modules,
                    _module_attributes(modules))  # fmt: skip


def _safe_fingerprint(read: Read) -> Any:
    try:
        return _fingerprint(read)
    except Exception:  # an attribute access of the user's that raises: compared as such
        return "<gone>"


def modules_known_before(
    fn: Callable[..., Any], reads: Sequence[Read], arguments: Sequence[nn.Module] = ()
) -> list[nn.Module]:
    """Modules reachable before the call: arguments, modules read by identity (from globals,
    closures or attribute paths) and a bound method's ``self``."""
    found: list[Any] = [*arguments, probe(fn, "__self__")]
    found += [r.expected for r in reads if r.kind is Kind.IDENTITY]
    unique = {id(m): m for m in found if isinstance(m, nn.Module)}
    return list(unique.values())


@dataclass
class Changing:
    """Record passes in a row that changed the Python state they read (NOTE [side effects of
    the step]): one that fills a cache (``if k not in cache:``) does it once per signature, on
    its first call; a counter does it on every call."""

    in_a_row: int = 0
    """Of any signature (a loader argument advancing its counter is a new signature each
    call)."""
    by_key: dict[Any, int] = field(default_factory=dict)
    """Of each signature."""

    def settled(self, key: Any, changed: bool) -> bool:
        """Whether a pass that ``changed`` state decides: the second in a row for its
        signature, or the third of any; else it returns its result and keeps no program."""
        if not changed:
            self.in_a_row = 0
            self.by_key.pop(key, None)
            return True
        self.in_a_row += 1
        self.by_key[key] = self.by_key.get(key, 0) + 1
        return self.by_key[key] >= 2 or self.in_a_row >= 3
