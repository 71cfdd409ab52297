"""Stage 1 (reads), canonical forms: a value read by the step as the bytes (or text) a guard
compares, which differ wherever a program reading the value may, where ``==`` calls them
equal: ``2`` and ``2.0``, ``-0.0`` and ``0.0``, ``1`` and ``True``, two orders of a dict or a
set, nested ones too (``_records.canonical`` picks the form; the guard's fetcher runs the same
forms as code, :data:`EXPRESSIONS`).
"""

from __future__ import annotations

import marshal
from typing import Any

__all__ = ["FORMS", "EXPRESSIONS", "GUARD_NAMES", "decoded", "form_of"]


def decoded(key: str, form: bytes | str) -> str:
    """The value a canonical form of kind ``key`` stands for, as text (a set's: a set)."""
    if isinstance(form, str):  # repr() already
        text = form
    elif key == "bytes":  # a buffer's bytes
        text = repr(form)
    else:
        value = marshal.loads(form)
        text = repr(set(value) if key == "set" else _with_sets(value))
    return text if len(text) <= 60 else text[:57] + "..."


_SET_MARK = "\x00phi_torch_jit set"
"""Heads the tuple a nested set is written as (:func:`_in_order`)."""
_MAPPING_MARK = "\x00phi_torch_jit mapping"
"""Heads the tuple a dict subclass's instance is written as (:func:`_in_order`)."""


def _in_order(value: Any) -> Any:
    """``value`` with each set or frozenset inside it as a tuple of its members in their
    order (headed by :data:`_SET_MARK` and its class): marshal sorts the sets it writes, and
    a loop over ``CFG["ids"]`` runs in the set's order (probe 38b); and each instance of a
    dict subclass (a ``Counter``, an ``OrderedDict``) as a tuple of its class's name and its
    entries in their order: marshal does not write them, and ``repr()`` lists a ``Counter``
    by count (probe 38c)."""
    cls = type(value)
    if cls is set or cls is frozenset:
        return (_SET_MARK, cls is frozenset, *map(_in_order, value))
    if cls is list:
        return list(map(_in_order, value))
    if cls is tuple:
        return tuple(map(_in_order, value))
    if cls is dict:
        return {_in_order(k): _in_order(v) for k, v in value.items()}
    if isinstance(value, dict):  # (a defaultdict's factory: as repr() showed it)
        entries = ((_in_order(k), _in_order(v)) for k, v in value.items())
        factory = repr(getattr(value, "default_factory", None))
        return (_MAPPING_MARK, f"{cls.__qualname__} {factory}", *entries)
    return value


def _nested_form(value: Any) -> bytes:
    return marshal.dumps(_in_order(value), 2)


def _ordered_apart(value: Any) -> bool:
    """Whether a set, a frozenset or a dict subclass's instance is ``value`` or lies inside
    it (a list, tuple or dict): what :func:`_in_order` writes in its order."""
    cls = type(value)
    if cls is set or cls is frozenset or (cls is not dict and isinstance(value, dict)):
        return True
    if cls is dict:
        return any(map(_ordered_apart, value)) or any(map(_ordered_apart, value.values()))
    return (cls is list or cls is tuple) and any(map(_ordered_apart, value))


def _with_sets(value: Any) -> Any:
    """A value read back from its nested form (:func:`_in_order`), its sets sets again."""
    cls = type(value)
    if cls is tuple and value[:1] == (_SET_MARK,):
        members = [_with_sets(v) for v in value[2:]]
        return frozenset(members) if value[1] else set(members)
    if cls is tuple and value[:1] == (_MAPPING_MARK,):  # shown as a dict (the class aside)
        return {_with_sets(k): _with_sets(v) for k, v in value[2:]}
    if cls is list or cls is tuple:
        return cls(map(_with_sets, value))
    if cls is dict:
        return {_with_sets(k): _with_sets(v) for k, v in value.items()}
    return value


FORMS: dict[str, Any] = {
    "marshal": lambda v: marshal.dumps(v, 2),  # version 2: no back-references (identity)
    "set": lambda v: marshal.dumps(tuple(v), 2),  # marshal sorts a set: its order is the loop's
    "nested": _nested_form,  # a container holding sets, each in its order
    "repr": repr,
    "bytes": bytes,  # what a buffer (an mmap) holds now
}
EXPRESSIONS = {"marshal": "_marshal({}, 2)", "set": "_marshal(tuple({}), 2)",
                "nested": "_nested({})", "repr": "repr({})", "bytes": "bytes({})"}  # fmt: skip
"""The same forms as code for the guard's fetcher (C calls only: no Python frame per read;
a container holding sets, rare, pays one)."""
GUARD_NAMES = {"_marshal": marshal.dumps, "_nested": _nested_form}
"""The names :data:`EXPRESSIONS` use, for the fetcher's scope."""


def form_of(value: Any) -> str:
    """Which of :data:`FORMS` writes ``value``: ``set`` for a set, ``nested`` for a container
    holding sets or dict subclasses (:func:`_in_order`), ``marshal`` otherwise."""
    if type(value) in (set, frozenset):
        return "set"
    try:
        return "nested" if _ordered_apart(value) else "marshal"
    except RecursionError:  # nested deeper than Python recurses: marshal refuses it too
        return "marshal"
