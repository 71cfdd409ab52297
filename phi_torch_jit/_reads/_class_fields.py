"""Stage 1 (reads): what a class of yours holds as data, for the walk's steps under it
(:mod:`._fields`): its data attributes (not methods, properties, classes), the data of a base
class that a subclass defines again (``super().K``), and the fields a dataclass keeps in
``__dataclass_fields__`` (as ``dataclasses.fields()`` returns them)."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

from ._code_walk import user_class
from ._records import PYTHONS_OWN, Step, probe

__all__ = [
    "class_data",
    "shadowed_bases",
    "dataclass_fields",
    "classes_held",
    "an_mro",
    "type_alias",
]


def shadowed_bases(klass: type) -> list[tuple[Step, ...]]:
    """The user's base classes of ``klass`` holding data that a class before them in its MRO
    defines again (``super().K``, ``type(s).__mro__[1].K``: the base's value is read, and
    the class's own walk sees only the override), each to walk as a class of its own."""
    mro = klass.__mro__
    return [
        (Step(True, "__mro__"), Step(False, i))
        for i, base in enumerate(mro)
        if i and user_class(base) and any(n in vars(k) for k in mro[:i] for n in class_data([base]))
    ]


_FIELDS = Step(True, "__dataclass_fields__")


def dataclass_fields(klass: type) -> list[tuple[Step, ...]]:
    """A dataclass's fields as ``dataclasses.fields(Cfg)`` returns them: each one's default,
    default factory and metadata (``f.metadata["unit"]``, a view of a dict of yours), which
    the step may read there (probe 47: ``Python's own`` ``__dataclass_fields__`` was not
    walked, and a default or a metadata dict changed later kept the first value)."""
    table = vars(klass).get("__dataclass_fields__")
    if not isinstance(table, dict):
        return []
    paths: list[tuple[Step, ...]] = []
    for name, field in list(table.items())[:64]:
        if not isinstance(name, str):
            continue
        for attribute in ("default", "default_factory", "metadata"):  # those it was given:
            held = probe(field, attribute)  # one guard read each, on every call
            empty = attribute == "metadata" and isinstance(held, Mapping) and not held
            if held is not dataclasses.MISSING and not empty:
                paths.append((_FIELDS, Step(False, name), Step(True, attribute)))
    return paths


def class_data(klasses: list[type]) -> list[str]:
    """Data attributes defined on these classes (no methods, properties, classes)."""
    names: list[str] = []
    for klass in klasses:
        for name, member in vars(klass).items():
            if name in PYTHONS_OWN or name in names or not name.isidentifier():
                continue
            if callable(member) or hasattr(type(member), "__get__"):
                continue  # methods, properties, cached properties: reading them runs code
            names.append(name)
    return names


def classes_held(items: tuple[Any, ...]) -> list[int]:
    """Where a tuple compared by value (``T = (A, 1)``, an enum's value, ``Optional[A]``'s
    arguments) holds a class of yours, or a tuple holding one: walked as read (probe 51)."""
    return [i for i, v in enumerate(items[:_MAX_ITEMS])
            if (isinstance(v, type) and user_class(v))
            or (type(v) is tuple and classes_held(v))]  # fmt: skip


def an_mro(path: tuple[Step, ...]) -> bool:
    """A path to a class's ``__mro__``, whose classes of yours are walked as the class's."""
    return bool(path) and path[-1].key == "__mro__"


_MAX_ITEMS = 64


def type_alias(value: Any) -> bool:
    """A type alias (``list[A]``, ``A | None``, ``typing.Optional[A]``): its arguments are
    what ``typing.get_args`` returns (probe 51)."""
    if isinstance(value, (types.GenericAlias, types.UnionType)):
        return True
    return type(value).__module__ == "typing" and isinstance(probe(value, "__args__"), tuple)
