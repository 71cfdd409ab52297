"""Stage 1 (reads): how each value a step reads is guarded (:class:`Kind`), and which values
no guard can hold because each call draws from them anew (random generators, clocks).

A random generator (``random.Random``, NumPy's ``RandomState``, ``Generator`` or bit
generator), a method bound to one (``from random import random``, ``RNG.normal``, a partial
of it) and a clock or entropy function (``from time import perf_counter``, ``os.urandom``)
read by the step are of kind :attr:`Kind.DRAWS`: the specialization runs eagerly, warned.
Names bound before the record pass's watch (:mod:`.._unguardable`) are not patched, so the
walk, which sees what each name is, finds them. A generator held but not drawn from in the
record pass (its state unchanged: ``_mutations.Snapshot.drawn``) is no reason to run
eagerly; a clock the code names is, even in a branch not taken.
"""

from __future__ import annotations

import builtins
import collections.abc
import datetime
import enum
import os
import pickle
import random
import time
import types
import uuid
import weakref
from collections.abc import Collection
from typing import Any

import torch

from .._callable_state import random_generator
from ._code_walk import user_class, user_module
from ._content import plain_container
from ._fields import has_attribute, masked
from ._records import PRIMITIVES, Kind, immutable

__all__ = ["kind_of", "big_array", "numbers_array", "MAX_ARRAY", "draws", "drawn_through",
           "generator_of", "generator_state"]  # fmt: skip

MAX_ARRAY = 4096
"""NumPy arrays up to this many elements are guarded by content, larger ones by identity."""

_BOUND = (types.BuiltinMethodType, types.MethodWrapperType, types.MethodType)

_CLOCK_NAMES = ("time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic",
                "monotonic_ns", "process_time", "process_time_ns", "thread_time",
                "thread_time_ns", "clock_gettime", "clock_gettime_ns")  # fmt: skip
_CLOCKS = frozenset(
    id(f)
    for f in (
        *(getattr(time, n) for n in _CLOCK_NAMES if hasattr(time, n)),
        *(getattr(os, n) for n in ("urandom", "getrandom", "times") if hasattr(os, n)),
        uuid.uuid1,
        uuid.uuid4,
    )
)
"""Functions that give a new value on every call (by identity: builtins are never copied)."""

_NOW = (datetime.datetime, datetime.date)
"""Classes whose ``now``, ``utcnow`` and ``today`` read the clock (C methods: not patched)."""


def draws(value: Any) -> bool:
    """Whether calling (or drawing from) ``value`` gives a new value on every call: a random
    generator, a method bound to one, a clock or an entropy source."""
    if isinstance(value, (types.BuiltinFunctionType, types.FunctionType)) and id(value) in _CLOCKS:
        return True
    if isinstance(value, _BOUND):  # (only these: a config's __getattr__ may raise anything)
        owner = value.__self__
        if any(owner is k for k in _NOW) and value.__name__ in ("now", "utcnow", "today"):
            return True
        return random_generator(owner) or isinstance(owner, _HIDDEN_STREAMS)
    return random_generator(value) or isinstance(value, _HIDDEN_STREAMS)


_HIDDEN_STREAMS = (pickle.Unpickler,)
"""Objects reading from a stream they keep in C, out of the walk's sight: each ``load()``
gives the next object (probe 44b)."""


def generator_of(value: Any) -> Any:
    """The generator object ``value`` is or is bound to; None for a clock or anything else."""
    owner = getattr(value, "__self__", None) if isinstance(value, _BOUND) else value
    return owner if random_generator(owner) else None


def generator_state(generator: Any) -> Any:
    """What a draw from ``generator`` changes, comparable with ``==`` (a ``SystemRandom``
    has none to read: a new object, never equal)."""
    if isinstance(generator, random.Random):
        try:
            return generator.getstate()
        except NotImplementedError:  # SystemRandom: draws from the operating system
            return object()
    bits = getattr(generator, "bit_generator", generator)  # a Generator's, or a BitGenerator
    state = generator.get_state(legacy=False) if hasattr(generator, "get_state") else bits.state
    return _comparable(state)


def _comparable(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _comparable(v) for k, v in state.items()}
    return state.tobytes() if hasattr(state, "tobytes") else state


def drawn_through(value: Any, names: Collection[str]) -> list[tuple[str, ...]]:
    """Attribute paths of one or two of ``names`` under a library's module or class that
    lead to a draw (``time.process_time``, ``datetime.datetime.now``, ``np.random.rand``):
    calls through a module's attribute that the record pass's patches do not see."""
    found: list[tuple[str, ...]] = []
    for first in names:
        below = getattr(value, first, None) if not first.startswith("__") else None
        if below is None:
            continue
        if draws(below):
            found.append((first,))
        elif isinstance(below, (types.ModuleType, type)):
            found += [(first, n) for n in names
                      if not n.startswith("__") and draws(getattr(below, n, None))]  # fmt: skip
    return found


def kind_of(value: Any) -> Kind:
    """How to guard ``value``. A user's module, and builtin functions other than Python's
    own (``torch.tanh`` held in a dict or a global), by identity, walked; a library's module
    and Python's builtins (``max``) held in a variable (``xp = np``, ``REDUCE = max``), by
    value (equal only to themselves), not walked: a variable rebound to another (``xp =
    torch``, ``REDUCE = min``) retraces (probe 43a). A name Python resolves in its builtins
    is never read here (``_python``: only names the module or ``builtins`` were given)."""
    if isinstance(value, torch.Tensor):
        return Kind.TENSOR
    if isinstance(value, types.ModuleType):
        return Kind.IDENTITY if user_module(value) else Kind.VALUE
    if draws(value):
        return Kind.DRAWS
    if isinstance(value, _BOUND) and getattr(value, "__name__", None) in ("__next__", "send"):
        if isinstance(value.__self__, collections.abc.Iterator):
            return Kind.ITERATOR
    if isinstance(value, types.BuiltinFunctionType):  # Python's own (max) held: which one
        return Kind.VALUE if value.__self__ is builtins else Kind.IDENTITY  # torch.tanh
    if isinstance(value, weakref.ProxyTypes):  # forwards __next__ whatever its object is
        return Kind.IDENTITY
    if isinstance(value, collections.abc.Iterator):
        return Kind.ITERATOR
    if immutable(value) or _tuple_of_plain_or_code(value):
        if _number_of_yours(value):  # K = Knob(2.0): what it holds (K.offset,
            return Kind.IDENTITY  # Knob.factor), walked as an object's
        return Kind.VALUE
    if masked(value):  # its data and its mask, each compared (fields)
        return Kind.IDENTITY
    if plain_container(value):
        return Kind.CONTENT
    if numbers_array(value) and getattr(value, "size", MAX_ARRAY + 1) <= MAX_ARRAY:
        return Kind.ARRAY
    return Kind.IDENTITY


def _number_of_yours(value: Any) -> bool:
    """A number or string of a subclass of yours (``class Knob(float)``), not an enum member:
    equal values may hold other attributes, instance or class ones."""
    kind = type(value)
    return kind not in PRIMITIVES and not isinstance(value, enum.Enum) and user_class(kind)


def _tuple_of_plain_or_code(value: Any) -> bool:
    """A plain tuple of plain values, classes and functions: ``tuple(d.keys())`` of a dict keyed
    by classes (``{float: 2.0}``, ``copyreg.dispatch_table``), a new tuple at every read, equal
    (``==``: the same classes, by identity) as long as the keys are. By identity it always
    changed, and the step ran eagerly as if it changed what it reads."""
    return type(value) is tuple and all(
        immutable(v)
        or isinstance(v, (type, types.FunctionType, types.BuiltinFunctionType))
        or _plain_record(v)
        for v in value
    )


def _plain_record(value: Any) -> bool:
    """A namedtuple of plain values (``tuple(TAB.keys())`` of a dict keyed by ``P("a")``: by
    identity it always changed, and the step ran eagerly, probe 51)."""
    fields = getattr(type(value), "_fields", None)
    return isinstance(value, tuple) and isinstance(fields, tuple) and all(map(immutable, value))


def numbers_array(value: Any) -> bool:
    """A NumPy-like array of numbers (one of objects is by identity, each walked: fields)."""
    return has_attribute(value, "__array_interface__") and not getattr(
        getattr(value, "dtype", None), "hasobject", True
    )


def big_array(value: Any) -> bool:
    """An array of numbers too big to compare at every call (by identity only)."""
    return numbers_array(value) and getattr(value, "size", 0) > MAX_ARRAY
