"""Stage 1 (reads): what a library's method, called by the user's code, reads of its own object.

A library's objects are guarded by identity (:func:`._fields.fields`): their internals are not
the user's state, and an object that counts its own calls (a scheduler's ``last_epoch``, a
progress bar) would retrace every call if they were. But a method the user's code calls reads
some of them, and a trace bakes what it returned: ``sched.get_last_lr()[0]`` returns
``self._last_lr``, which ``sched.step()`` replaces between calls. So, for each library object
the walk read (however it was reached: a global, a helper's argument, a partial, a list, an
attribute of a module of yours) and each method or property of its class whose name the walked
code spells, and for a bound method of a library object held (``get = sched.get_last_lr``),
the plain values the method's code reads from ``self`` (or a local it stored ``self`` under;
and in the methods it calls on ``self``, one level further) are guarded by value: numbers,
strings, small containers of them; tensors it reads become inputs of the program (a
transform's ``scale`` changed in place). A library's objects it reads, alone or in a list
(``self.transforms``), are read in turn, for the methods the reading method's code spells.
See NOTE [libraries' settings] in docs/design.md.
"""

from __future__ import annotations

import dis
import functools
import inspect
import types
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ._code_walk import codes, names_used, user_class
from ._content import plain_container
from ._kinds import numbers_array
from ._reachable import CONTAINERS
from ._records import Kind, Read, Source, Step, immutable, probe

__all__ = ["library_objects_read"]

_DEPTH = 2
"""The method, and the methods of the object it calls (``get_last_lr`` -> ``_get_lr``)."""
_ROUNDS = 3
"""Objects a method reads (``self.optimizer``, ``logger.parent``) are read in turn, so deep."""
_SYNTAX = frozenset(("__len__", "__bool__"))
"""Methods that syntax calls without the code spelling them (``len(subset)``, ``if d:``).
Not ``__call__``: which read object the code calls is not known here, and every library
object holding one (a jitted function's call counter, a clock) would be read through it."""
_CONVERSIONS = {
    "float": ("__float__", "__index__"),
    "int": ("__int__", "__index__", "__trunc__"),
    "complex": ("__complex__", "__float__", "__index__"),
    "abs": ("__abs__",),
    "round": ("__round__",),
    "range": ("__index__",),
}
"""Methods a builtin the code spells calls on its argument (``float(fraction)``): what the
object reads there makes the number the trace bakes."""
_ARITHMETIC = ("BINARY_OP", "BINARY_MULTIPLY", "BINARY_ADD", "BINARY_SUBTRACT",
               "BINARY_TRUE_DIVIDE")  # fmt: skip
"""Arithmetic opcodes (3.11+: one; 3.10: one per operator)."""
_OPERATORS = {
    **dict.fromkeys(_ARITHMETIC, ("__float__", "__index__", "__int__")),  # x * fraction: torch
    "COMPARE_OP": ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"),  # converts it
    "BEFORE_WITH": ("__enter__", "__exit__"),  # with NC as d: what __enter__ returns of it
    "SETUP_WITH": ("__enter__", "__exit__"),  # (3.10)
}
"""Methods the code's syntax calls on a library object (its value as a number, a
comparison's answer, what a ``with`` block enters: probe 42a)."""
_IMPLIED: dict[types.CodeType, frozenset[str]] = {}
_ATTRIBUTE_LOADS = frozenset(("LOAD_ATTR", "LOAD_METHOD"))
_SELF_LOADS = frozenset(("LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE"))
_WHOLE = "__dict__"
"""Read as an attribute (``self.__dict__``, ``vars(self)``): every plain value is read."""
_CACHE: dict[types.CodeType, tuple[frozenset[str], frozenset[str]]] = {}
_SELF = Step(True, "__self__")


def library_objects_read(
    reads: Mapping[Any, Read], functions: Iterable[types.FunctionType]
) -> list[tuple[Any, Source]]:
    """What the library methods the walked ``functions`` call read of their objects, as (key,
    source) pairs to add to ``reads``. For each library object read (guarded by identity)
    and each name the functions spell that is a method or property of its class (and
    ``__len__``, ``__bool__``), and for each bound method of a library object held
    (``get = sched.get_last_lr``): the object's attributes the method reads as
    ``self.<name>`` (all of them where it reads ``self.__dict__``), and those the functions
    spell by name (``d.my_k`` in a helper given the object). Plain values are guarded by
    value; library objects among them (``self.optimizer``, ``logger.parent``) by identity,
    walked as any read object, and their methods' reads found in turn."""
    spelled: set[str] = set(_SYNTAX)
    for function in functions:
        spelled |= names_used(function.__code__) | _implied(function.__code__)
    if "vars" in spelled:  # vars(sched)[...]: which object is not known
        spelled.add(_WHOLE)
    found: list[tuple[Any, Source]] = []
    pending = [(key, r.source, r.expected, frozenset(spelled))
               for key, r in reads.items() if _object_read(r)]  # fmt: skip
    for _ in range(_ROUNDS):
        below = []
        for key, source, value, names in pending:
            if isinstance(value, types.MethodType):  # held bound: its object, what it reads
                owner, source, methods = value.__self__, source.child(_SELF), [value.__func__]
                named: Iterable[str] = ()
            else:  # the methods the code spells, and attributes it spells
                owner, named = value, names
                klass = type(value)
                methods = [m for n in sorted(names) if (m := _member(klass, n)) is not None]
            deeper = names | _spelled_by(methods)  # what the methods call on what they read
            for name, held in _state_read(owner, methods, named):
                child = source.child(Step(True, name))
                found.append(((key, "self", name), child))
                below += [(k, s, v, deeper) for k, s, v in _objects_in((key, "self", name),
                                                                       child, held)]  # fmt: skip
        pending = below
    return found


def _spelled_by(methods: Iterable[Any]) -> frozenset[str]:
    """The names the code of ``methods`` spells: what they call on the objects they read
    (``transform.log_abs_det_jacobian`` in ``TransformedDistribution.log_prob``)."""
    codes_of = (getattr(m, "__code__", None) for m in methods)
    return frozenset().union(*(names_used(c) for c in codes_of if isinstance(c, types.CodeType)))


def _objects_in(key: Any, source: Source, held: Any) -> list[tuple[Any, Source, Any]]:
    """The library objects below an attribute a method read, to read in turn: the object
    itself, or those a list or tuple holds (``self.transforms`` of a distribution, each
    transform's ``scale``: probe 43b), by position."""
    if _library_object(held):
        return [(key, source, held)]
    if type(held) in (list, tuple) and len(held) <= _MAX_LISTED:
        return [((key, i), source.child(Step(False, i)), v)
                for i, v in enumerate(held) if _library_object(v)]  # fmt: skip
    return []


_MAX_LISTED = 64
"""A list or tuple of a library's objects longer than this is read by length and identity."""


def _implied(code: types.CodeType) -> frozenset[str]:
    """The methods ``code`` (and the code nested in it) calls without spelling them: numeric
    conversions of the builtins it names (``float(x)``), and its operators'."""
    found = _IMPLIED.get(code)
    if found is None:
        names: set[str] = set()
        for inner in codes(code):
            for name in inner.co_names:
                names.update(_CONVERSIONS.get(name, ()))
            for instruction in dis.get_instructions(inner):
                names.update(_OPERATORS.get(instruction.opname, ()))
        found = _IMPLIED[code] = frozenset(names)
    return found


def _object_read(read: Read) -> bool:
    """An object read by identity, or a bound method (compared by equality: ``_python``)."""
    return read.kind is Kind.IDENTITY or isinstance(read.expected, types.MethodType)


def _member(klass: type, name: str) -> Any:
    """The function behind ``klass``'s method or property ``name`` (None for others)."""
    try:
        member = inspect.getattr_static(klass, name)
    except AttributeError:
        return None
    if isinstance(member, property):
        member = member.fget
    return member if isinstance(member, types.FunctionType) else None


def _state_read(
    owner: Any, methods: Iterable[Any], named: Iterable[str] = ()
) -> list[tuple[str, Any]]:
    """(name, value) of ``owner``'s instance attributes that ``methods`` (functions of its
    class) read as ``self.<name>``, or that are ``named``, holding plain values or a library's
    objects; none for the user's objects (walked as state), classes, modules and
    ``nn.Module`` s (the module guard)."""
    if _walked_otherwise(owner):
        return []
    state = probe(owner, "__dict__")
    if type(state) is not dict:  # a class with __slots__ (fractions.Fraction): what its
        state, named = _slots(owner), ()  # methods read (slots hold no data of yours)
        if not state:
            return []
    names: set[str] = set(named)
    seen: set[types.CodeType] = set()
    for method in methods:
        names |= _read_from_self(method, type(owner), _DEPTH, seen)
    if _WHOLE in names:
        names |= set(state)
    return [
        (n, state[n])
        for n in sorted(names)
        if n in state and (_plain(state[n]) or _library_object(state[n]) or _listed(state[n])
                           or isinstance(state[n], torch.Tensor)  # an input of the program
                           or numbers_array(state[n]))  # by content (a polynomial's coef)
    ]  # fmt: skip


def _listed(value: Any) -> bool:
    """A list or tuple of plain values and a library's objects (``self.transforms``): by
    identity, length and item (``_python``), each object read in turn (:func:`_objects_in`)."""
    return type(value) in (list, tuple) and all(
        _plain(v) or _library_object(v) for v in value[:_MAX_LISTED]
    )


_MISSING = object()


def _slots(owner: Any) -> dict[str, Any]:
    """The set slots of ``owner``'s classes, by name (an object without ``__dict__``)."""
    found: dict[str, Any] = {}
    for klass in type(owner).__mro__:
        slots = vars(klass).get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if isinstance(name, str) and name not in ("__dict__", "__weakref__"):
                value = probe(owner, name, _MISSING)
                if value is not _MISSING:
                    found.setdefault(name, value)
    return found


def _walked_otherwise(value: Any) -> bool:
    return isinstance(value, (type, types.ModuleType, nn.Module)) or user_class(type(value))


def _library_object(value: Any) -> bool:
    """An object of a library's class with attributes (not a container, tensor or code; a
    callable object, a distribution's transform, is one)."""
    if _walked_otherwise(value) or isinstance(value, (torch.Tensor, *CONTAINERS, *_CODE)):
        return False
    return type(probe(value, "__dict__")) is dict


_CODE = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)


def _plain(value: Any) -> bool:
    return immutable(value) or plain_container(value)


def _read_from_self(function: Any, klass: type, depth: int, seen: set[types.CodeType]) -> set[str]:
    code = getattr(function, "__code__", None)
    if not isinstance(code, types.CodeType) or code in seen or not code.co_varnames:
        return set()
    seen.add(code)
    attributes, called = _self_names(code)
    found = set(attributes)
    if depth > 1:
        for name in called | {a for a in attributes if _is_property(klass, a)}:
            member = getattr(klass, name, None)  # a method, or a property's getter
            member = member.fget if isinstance(member, property) else member
            found |= _read_from_self(member, klass, depth - 1, seen)
    return found


def _is_property(klass: type, name: str) -> bool:
    """Whether ``self.<name>`` runs a property of ``klass`` (``poly1d.coeffs`` reads
    ``self._coeffs``)."""
    return isinstance(getattr(klass, name, None), property)


def _self_names(code: types.CodeType) -> tuple[frozenset[str], frozenset[str]]:
    """(attributes loaded from the first argument, those of them called) in ``code`` and the
    code nested in it: from the argument, a local it was stored under (``logger = self;
    ... logger.level``), or the cell nested code reads it from (a comprehension over
    ``self.base_lrs``, a closure). ``vars(self)`` counts as ``self.__dict__``."""
    found = _CACHE.get(code)
    if found is None:
        receivers = {code.co_varnames[0]} if code.co_argcount else set()
        attributes: set[str] = set()
        called: set[str] = set()
        for inner in codes(code):
            listed = list(dis.get_instructions(inner))
            for n in range(1, len(listed)):
                load, instruction = listed[n - 1], listed[n]
                if load.opname not in _SELF_LOADS or load.argval not in receivers:
                    continue
                if inner is not code and load.opname == "LOAD_FAST":
                    continue  # a nested function's own argument of the same name
                if instruction.opname == "STORE_FAST" and inner is code:
                    receivers.add(instruction.argval)
                elif instruction.opname in _ATTRIBUTE_LOADS:
                    attributes.add(instruction.argval)
                    if instruction.opname == "LOAD_METHOD":
                        called.add(instruction.argval)
                elif n > 1 and listed[n - 2].opname == "LOAD_GLOBAL":
                    if listed[n - 2].argval == "vars":  # vars(self)
                        attributes.add(_WHOLE)
        found = _CACHE[code] = (frozenset(attributes), frozenset(called))
    return found
