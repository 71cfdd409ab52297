"""Stage 0 (signature), the state of a callable argument: what its cache key holds.

A callable object passed to a jitted function (``step(x, forcing)`` with ``forcing.amplitude``)
is keyed by identity and by :func:`plain_attributes`, so that ``forcing.amplitude = 5.0``
retraces; deeper state, and what bound methods and partials hold, is guarded by the Python
guards (:mod:`._reads`), rooted at the argument.
"""

from __future__ import annotations

import enum
import functools
import random
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

from ._reads._records import enum_attributes

__all__ = ["PRIMITIVES", "NOT_STATEFUL", "plain_attributes", "enum_key", "random_generator",
           "left_to_guards", "holds_objects", "TensorAttributes"]  # fmt: skip

PRIMITIVES = frozenset(
    {type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout}
)


NOT_STATEFUL = (types.FunctionType, types.MethodType, types.BuiltinFunctionType,
                types.BuiltinMethodType, type, functools.partial, types.ModuleType)  # fmt: skip
"""Callables keyed by identity alone (functions' code and partials' arguments are read
where they are called: the Python guards)."""


def plain_attributes(obj: Any) -> tuple[tuple[str, Any], ...]:
    """(name, key) of the state a callable object holds: numbers, strings, enums and tuples of
    them by value (their ``repr()``), lists and dicts of those by content, tensors, functions,
    classes and other objects by identity (a rebound ``self.w``; two objects equal by their
    ``__eq__`` holding different dicts or functions); its ``__slots__`` too, and the class
    attributes it reads through ``self`` (the user's classes: not a library's; their names
    looked up once per class)."""
    found = {name: getattr(obj, name) for name in _class_names(type(obj)) if hasattr(obj, name)}
    found.update(getattr(obj, "__dict__", {}))
    keyed: list[tuple[str, Any]] = []
    for name, value in found.items():
        if isinstance(value, torch.Tensor):
            keyed.append((name, ("tensor", id(value))))
        elif _plain(value) or (
            type(value) in (list, dict)
            and len(value) <= 64
            and all(map(_plain, value))
            and (type(value) is list or all(map(_plain, value.values())))
        ):  # by repr(): 2 and 2.0, -0.0 and 0.0, 1 and True are == alike
            keyed.append((name, repr(value)))
        else:  # another object, a function, a class, a module: which one (its state, and
            keyed.append((name, ("object", id(value))))  # the code it holds, are guarded
            # where the step reads them, rooted at the first object keyed: probe 44a found a
            # function held by an argument equal by its __eq__ unkeyed and unwalked)
    return tuple(keyed)


def enum_key(member: enum.Enum) -> tuple[tuple[str, Any], ...]:
    """(name, key) of an enum member's own attributes (:func:`enum_attributes`): plain values
    by ``repr()``, others by identity (what they hold is guarded where the step reads it)."""
    keyed = []
    for name in enum_attributes(member):
        value = getattr(member, name)
        keyed.append((name, repr(value) if _plain(value) else ("object", id(value))))
    return tuple(keyed)


_CLASS_NAMES: dict[type, tuple[str, ...]] = {}


def _class_names(klass: type) -> tuple[str, ...]:
    """Plain class attributes (``SCALE = 2.0``) and ``__slots__`` of a callable argument's
    classes, libraries' (torch, functools, builtins) skipped."""
    names = _CLASS_NAMES.get(klass)
    if names is None:
        found: dict[str, None] = {}
        for base in reversed(klass.__mro__[:-1]):
            if getattr(base, "__module__", "").split(".")[0] in ("torch", "builtins", "functools"):
                continue
            slots = getattr(base, "__slots__", ())
            found.update(dict.fromkeys((slots,) if isinstance(slots, str) else slots))
            found.update({n: None for n, v in vars(base).items() if n[:2] != "__" and _plain(v)})
        names = _CLASS_NAMES[klass] = tuple(found)
    return names


def _plain(value: Any) -> bool:
    if type(value) in PRIMITIVES or isinstance(value, enum.Enum):
        return True
    return type(value) is tuple and all(_plain(v) for v in value)


def random_generator(value: Any) -> bool:
    """A random generator object of Python's (``SystemRandom`` too) or NumPy's (``RandomState``,
    ``Generator``, a bit generator): each draw changes it, and no hash of it says so."""
    if isinstance(value, random.Random):
        return True
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is None:
        return False
    kinds = tuple(getattr(numpy_random, n, None) for n in ("RandomState", "Generator",
                                                           "BitGenerator"))  # fmt: skip
    return isinstance(value, tuple(k for k in kinds if isinstance(k, type)))


def holds_objects(value: Any) -> bool:
    """An object keyed by its plain attributes (one of yours with an ``__eq__`` of its own)
    that holds other objects or tensors, keyed by identity: what the step reads of them is
    left to the Python guards, rooted at it (probe round 35d: ``cfg.sub.k`` changed in place,
    or a tensor it holds written in place, was stale)."""
    if type(value) in PRIMITIVES or isinstance(value, (enum.Enum, *NOT_STATEFUL)):
        return False
    keys = plain_attributes(value)
    return any(type(key) is tuple and key[0] in ("object", "tensor") for _, key in keys)


def left_to_guards(value: Any) -> bool:
    """An argument without a value hash that is keyed by identity, what the step reads of it
    left to the Python guards: a configuration module (its data guarded), an iterator or a
    random generator (advanced or drawn from in the record pass: the call runs eagerly)."""
    return isinstance(value, (types.ModuleType, Iterator, torch.Generator)) or random_generator(
        value
    )


class TensorAttributes:
    """The Python attributes set on a tensor argument (``x.scale = 2.0``), keyed like a
    callable object's (:func:`plain_attributes`: plain values by ``repr()``, others by
    identity), and held to be set on the tensors a trace runs with: a read with a default
    (``getattr(x, "scale", 1.0)``) baked the default (probe 45b)."""

    def __init__(self, own: dict[str, Any]) -> None:
        self.values = dict(own)
        self.key = plain_attributes(types.SimpleNamespace(**self.values))
        if any(isinstance(value, torch.Tensor) for value in own.values()):
            # a tensor set on it is a constant of the program: written in place, it retraces
            # (probe 46a: ``x.w.fill_(3.0)`` kept the first value)
            self.key += tuple((name, _version(value)) for name, value in own.items()
                              if isinstance(value, torch.Tensor))  # fmt: skip

    def set_on(self, tensor: torch.Tensor) -> None:
        held = tensor.__dict__
        for name, value in self.values.items():
            if held.get(name, TensorAttributes) is not value:
                held[name] = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorAttributes) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return ", ".join(f"{name}={value}" for name, value in self.key)


def _version(tensor: torch.Tensor) -> int:
    """How often ``tensor`` was written in place; -1 for an inference tensor, which does not
    count (its writes are not seen, as for any inference tensor: docs/guarded.md)."""
    return -1 if tensor.is_inference() else tensor._version
