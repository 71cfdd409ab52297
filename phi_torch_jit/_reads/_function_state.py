"""Stage 1 (reads): what a function of the user's holds or reaches besides its globals and
cells: its code, its defaults and the attributes set on it, and the methods of yours it calls
on torch's tensor class (``x.scaled()`` after ``torch.Tensor.scaled = scaled``)."""

from __future__ import annotations

import types
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ._code_walk import user_class
from ._fields import INSTANCE_DICT
from ._reachable import methods_set_on_tensors
from ._records import LENGTH, PYTHONS_OWN, Kind, Read, Source, Step, immutable

__all__ = ["ANNOTATION_READERS", "annotation_sources", "function_sources"]

_MAX_ATTRIBUTES = 512
"""Attributes set on one function that are guarded."""

ANNOTATION_READERS = frozenset(("__annotations__", "get_type_hints", "get_annotations",
                                "signature", "getfullargspec", "annotation",
                                "return_annotation"))  # fmt: skip
"""Names whose use in walked code reads annotations, often through a library's call
(``typing.get_type_hints(helper)``, ``inspect.signature(f).parameters["x"].annotation``): the
annotations of the functions and classes of yours the walk reached are then guarded."""


def function_sources(function: types.FunctionType) -> list[tuple[Any, Source]]:
    """(key, source) pairs of what ``function`` holds or reaches this way, for the guard."""
    return [*_defaults(function), *_code(function), *_tensor_methods(function)]


def _defaults(function: types.FunctionType) -> list[tuple[Any, Source]]:
    """Default values of a function's parameters that can change in place (``coeffs=[1.0]``
    then ``coeffs[0] = 5.0`` through ``__defaults__``), and keyword-only defaults."""
    code = function.__code__
    where = f"{code.co_filename}:{code.co_firstlineno}"
    found: list[tuple[Any, Source]] = []
    defaults = function.__defaults__ or ()
    names = code.co_varnames[code.co_argcount - len(defaults) : code.co_argcount]
    for name, value in zip(names, defaults):
        if not immutable(value):
            source = Source(f"default of {name} ({code.co_name})", where, holder=value)
            found.append(((id(function), name), source))
    keywords = function.__kwdefaults__ or {}
    for name in keywords:
        source = Source(f"default of {name} ({code.co_name})", where, keywords, name)
        found.append(((id(keywords), name), source))
    return found


def _code(function: types.FunctionType) -> list[tuple[Any, Source]]:
    """What a function runs and holds, as its own attributes: its code by identity, its
    defaults (``f.__code__ = g.__code__``, ``f.__defaults__ = (0.5,)`` retrace; only where it
    has some: a read costs about 0.1 us on every call), and the attributes set on it
    (``f.scale = 2.0``; one added or deleted later changes their count)."""
    code = function.__code__
    where = f"{code.co_filename}:{code.co_firstlineno}"
    found: list[tuple[Any, Source]] = []
    for attribute in ("__code__", "__defaults__", "__kwdefaults__"):
        if getattr(function, attribute) is None:
            continue
        label = f"{function.__qualname__}.{attribute}"
        source = Source(label, where, holder=function, path=(Step(True, attribute),))
        found.append(((id(function), attribute), source))
    own = [n for n in function.__dict__ if n not in PYTHONS_OWN]  # (fn.__opts__: 39a)
    paths = [(INSTANCE_DICT, LENGTH), *((Step(True, n),) for n in own[:_MAX_ATTRIBUTES])]
    for path in paths:
        label = function.__qualname__ + (f".{path[0].key}" if len(path) == 1 else " attributes")
        found.append(((id(function), path), Source(label, where, holder=function, path=path)))
    return found


def _tensor_methods(function: types.FunctionType) -> list[tuple[Any, Source]]:
    """The methods of yours set on ``torch.Tensor`` under names ``function``'s code spells, by
    identity (``torch.Tensor.scaled = other`` retraces; their code is walked as yours)."""
    code = function.__code__
    where = f"{code.co_filename}:{code.co_firstlineno}"
    return [
        (("tensor method", name),
         Source(f"torch.Tensor.{name}", where, holder=torch.Tensor, path=(Step(True, name),)))
        for name in methods_set_on_tensors(code)
    ]  # fmt: skip


def annotation_sources(
    functions: Sequence[types.FunctionType], reads: Iterable[Read], spelled: frozenset[str]
) -> list[tuple[Any, Source]]:
    """The annotations of ``functions`` and of the classes of yours among ``reads``, by
    content: one changed in place, or replaced, retraces. Only where the walked code spells
    (``spelled``) an :data:`ANNOTATION_READERS` name: the guard reads each dict on every call."""
    if spelled.isdisjoint(ANNOTATION_READERS):
        return []
    classes = [r.expected for r in reads if r.kind is Kind.IDENTITY
               and isinstance(r.expected, type) and user_class(r.expected)]  # fmt: skip
    found: list[tuple[Any, Source]] = []
    holders: list[Any] = [*functions, *classes]
    for holder in holders:
        annotations = getattr(holder, "__annotations__", None)
        if not isinstance(annotations, dict) or not annotations:
            continue
        code = getattr(holder, "__code__", None)
        where = f"{code.co_filename}:{code.co_firstlineno}" if code else holder.__module__
        label = f"{holder.__qualname__}.__annotations__"
        path = (Step(True, "__annotations__"),)
        found.append(((id(holder), "__annotations__"), Source(label, where, holder=holder,
                                                              path=path)))  # fmt: skip
    return found
