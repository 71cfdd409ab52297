"""Stage 1 (reads): values of yours kept on a library's module, class or object, however the
step reaches the holder and however it names the value.

``json.gain = 2.0`` read as ``json.gain`` follows a path the code spells from a global, and is
guarded there. The same value read as ``getattr(json, "gain", 1.0)``, ``vars(json).get(...)``,
``hasattr(torch, "my_flag")`` (set later), or as ``cls.gain`` in a helper handed
``torch.nn.Linear``, a class in a list, a partial's argument or a default, was not: the walk
does not look inside a library's objects, whose internals are not the user's (probe 50).

Now every library module, class and object the walk read by identity is looked at under the
names the walked code spells (attributes, ``co_names``) and the identifier strings it holds
(``getattr``'s argument): an entry there that holds a value of yours (a number, a string, a
small container of them, an object or function of yours, a static or class method wrapping
one) is guarded like a global; an absent name the code holds as a string is guarded as
absent (``hasattr`` answers differently once it is set). A library's own functions, classes
and modules stay out (replacing one is a documented limitation), and so do its objects' other
state: an optimizer's ``state`` changes every step.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from torch import nn

from ._code_walk import codes, user_class, user_function, user_module
from ._records import PYTHONS_OWN, Kind, Read, Source, Step, probe
from ._shown import got_names

__all__ = ["holder_sources", "names_held"]

_MAX_HOLDERS = 64
"""Library modules, classes and objects looked at per walk."""
_MAX_ABSENT = 32
"""Names guarded as absent from library modules and classes, per walk."""
_MAX_ITEMS = 64
"""Items of a container on a holder that are looked at to tell whether it is yours."""


DYNAMIC = frozenset(("getattr", "hasattr", "vars", "__dict__", "getattr_static"))
"""Names through which code reads attributes named by strings."""


def names_held(functions: Iterable[types.FunctionType], values: Iterable[Any]) -> frozenset[str]:
    """The identifier strings held as constants by the code of ``functions`` that reads
    attributes by name (``getattr(json, "gain")``, :data:`DYNAMIC`), and the names an
    ``operator.attrgetter`` among ``values`` reads (``attrgetter("gain")(json)``)."""
    found = {c for f in functions for inner in codes(f.__code__)
             if not DYNAMIC.isdisjoint(inner.co_names)
             for c in inner.co_consts if isinstance(c, str)}  # fmt: skip
    for value in values:
        found.update(got_names(value))  # attrgetter("gain")
        if type(value) is str:  # NAME = "gain"; getattr(json, NAME)
            found.add(value)
    return frozenset(n for n in found if n.isidentifier())


def holder_sources(
    reads: Mapping[Any, Read], spelled: frozenset[str], held: frozenset[str]
) -> Iterator[tuple[Any, Source]]:
    """(key, source) of the values of yours on the library holders among ``reads`` under
    ``spelled`` names or ``held`` strings, and of the ``held`` names absent there."""
    seen: set[tuple[int, str]] = set()
    absent = [_MAX_ABSENT]
    for holder, where in _holders(reads, spelled):
        for owner, namespace in _namespaces(holder):
            label = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", "")
            label = label or f"{type(owner).__name__} object"
            for name in (spelled | held) & namespace.keys():
                if (id(owner), name) in seen or name in PYTHONS_OWN:
                    continue
                if name.startswith("_") and owner is holder and _plain(owner):
                    continue  # an object's private state is the library's (_step_count)
                seen.add((id(owner), name))
                if _yours(namespace[name]):
                    path = (Step(True, name),)
                    source = Source(f"{label}.{name}", where, holder=owner, path=path)
                    yield ("library holder", id(owner), name), source
        if _plain(holder):
            continue  # absent names: only on modules and classes (hasattr(torch, "flag"))
        for name in sorted(held - _seen_names(seen, holder)):
            if name.startswith("__") or absent[0] <= 0:
                continue
            absent[0] -= 1
            seen.add((id(holder), name))
            own = (Step(True, "__dict__"), Step(True, "__contains__", call=True, argument=name))
            label = f"{name!r} in vars({holder.__name__})"
            yield ("library holder has", id(holder), name), Source(label, where, holder=holder,
                                                                   path=own)  # fmt: skip


def _holders(reads: Mapping[Any, Read], spelled: frozenset[str]) -> list[tuple[Any, str]]:
    """The library modules, classes and objects read, those in a tuple or list read (a
    partial's arguments, ``CLASSES = [json.JSONDecoder]``), and the modules and classes under
    spelled names of a module among them (``read(torch.nn.Linear)``), each once, with where."""
    found: dict[int, tuple[Any, str]] = {}
    pending: list[tuple[Any, str]] = []
    for read in reads.values():
        if read.kind is not Kind.TENSOR:
            value = read.expected
            items = value[:_MAX_ITEMS] if type(value) in (tuple, list) else (value,)
            pending += [(item, read.source.location) for item in items]
    while pending and len(found) < _MAX_HOLDERS:
        item, where = pending.pop(0)
        if id(item) in found or not _library(item):
            continue
        found[id(item)] = (item, where)
        if isinstance(item, types.ModuleType):  # torch -> nn -> Linear, as the code spells
            namespace = vars(item)
            pending += [(namespace[n], where) for n in sorted(spelled & namespace.keys())
                        if isinstance(namespace[n], (types.ModuleType, type))]  # fmt: skip
    return list(found.values())


def _seen_names(seen: set[tuple[int, str]], holder: Any) -> set[str]:
    """The names already looked at on ``holder`` itself."""
    return {name for ident, name in seen if ident == id(holder)}


def _library(value: Any) -> bool:
    """A library's module, class or plain object (not torch's modules: the module guard's;
    not a function: code, walked elsewhere)."""
    if isinstance(value, types.ModuleType):
        return not user_module(value)
    if isinstance(value, type):
        return not user_class(value)
    if isinstance(value, (nn.Module, types.FunctionType, types.BuiltinFunctionType)):
        return False
    return not user_class(type(value)) and isinstance(probe(value, "__dict__"), dict)


def _plain(holder: Any) -> bool:
    """An object, not a module or class."""
    return not isinstance(holder, (types.ModuleType, type))


def _namespaces(holder: Any) -> list[tuple[Any, Mapping[str, Any]]]:
    """Where a holder keeps what is set on it: a module's globals, a class's dict and its
    library bases' (``Linear.gain`` set on ``nn.Module``), an object's ``__dict__``."""
    if isinstance(holder, type):
        return [(k, vars(k)) for k in holder.__mro__ if k is not object and not user_class(k)]
    own = probe(holder, "__dict__")
    found: list[tuple[Any, Mapping[str, Any]]] = [(holder, own)] if isinstance(own, dict) else []
    if isinstance(holder, types.ModuleType):
        return found
    return found + _namespaces(type(holder))  # o.k, set as JSONDecoder.k = 2.0


def _yours(value: Any) -> bool:
    """A value the user set, not the library's machinery: numbers and strings (a library's
    own constants do not change), an object or function of yours, a static or class method
    of yours, a plain list, tuple, set or dict of those."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, types.FunctionType):
        return user_function(value)
    if _plain_value(value):
        return True
    if type(value) in (list, tuple, set, frozenset, dict):
        items = list(value.values() if isinstance(value, dict) else value)[:_MAX_ITEMS]
        return all(_plain_value(i) or _of_yours(i) for i in items)
    return _of_yours(value)


_PLAIN = (int, float, complex, str, bytes, bool, type(None))


def _plain_value(value: Any) -> bool:
    """A number, a string, None, or a tuple of them: not a library's own names of types
    (``torch.float64``, a device, an enum member of its own)."""
    if type(value) is tuple:
        return all(_plain_value(v) for v in value)
    return type(value) in _PLAIN


def _of_yours(value: Any) -> bool:
    if isinstance(value, types.FunctionType):
        return user_function(value)
    return not isinstance(value, type) and user_class(type(value))
