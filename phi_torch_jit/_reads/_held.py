"""Stage 1 (reads): the objects a jitted callable holds besides code, and how it is named.

A partial's arguments and keywords, a bound method's ``self`` (or ``cls``), the jitted module
or callable object: their state is read through parameters, not names, so each is a root of
the walk of its own (NOTE [attribute paths]).
"""

from __future__ import annotations

import functools
import types
from typing import Any

from torch import nn

from ._code_walk import MAX_DEPTH, user_function
from ._reachable import wrapper_cells
from ._records import LENGTH, Source, probe

__all__ = ["held_objects", "describe_callable"]


def held_objects(fn: Any, role: str = "the jitted") -> list[tuple[Any, Source]]:
    """The objects a jitted callable holds besides code: the arguments and keywords of a
    ``functools.partial`` (``partial(relax, cfg=cfg)``), a bound method's ``self``, the
    jitted module or callable object itself; their attributes are read through parameters,
    not names, so they are guarded as roots of their own (NOTE [attribute paths]). ``role``
    names ``fn`` in messages: ``the jitted``, or what it is to the call (``a hook``)."""
    found: list[tuple[Any, Source]] = []
    pending, seen = [fn], 0
    while pending and seen < MAX_DEPTH:
        obj, seen = pending.pop(), seen + 1
        where = describe_callable(obj)
        if isinstance(obj, functools.partial):
            for i, value in enumerate(obj.args):
                found.append(((id(obj), i), Source(f"partial argument {i}", where, holder=value)))
            for name in obj.keywords:
                source = Source(f"partial keyword {name}", where, obj.keywords, name)
                found.append(((id(obj), name), source))
            added = Source("partial keywords", where, holder=obj.keywords, path=(LENGTH,))
            found.append(((id(obj), "keywords"), added))  # a keyword added later
            pending.append(obj.func)
            label = f"{type(obj).__name__} object (a partial)"  # what is set on it (P.k =
            found.append(((id(obj), "self"), Source(label, where, holder=obj)))  # 2.0, probe
            # 49), and a subclass's attributes and class
        elif isinstance(obj, types.MethodType):
            owner = obj.__self__  # an object, or the class of a classmethod (cls.K)
            name = owner.__qualname__ if isinstance(owner, type) else type(owner).__name__
            role = "(cls" if isinstance(owner, type) else "object (self"
            label = f"{name} {role} of {obj.__name__})"
            found.append(((id(owner), "self"), Source(label, where, holder=owner)))
        elif isinstance(obj, types.FunctionType) and "__wrapped__" in obj.__dict__:
            cells = dict(zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=False))
            for name in wrapper_cells(obj) if not user_function(obj) else ():
                source = Source(f"closure {name} of {obj.__qualname__}", where, cell=cells[name])
                found.append(((id(cells[name]), "cell"), source))  # @Scaled(k) around fn
            pending.append(obj.__dict__["__wrapped__"])
        elif isinstance(obj, nn.Module):
            label = f"{type(obj).__name__} object ({_role(role, 'module')})"
            found.append(((id(obj), "self"), Source(label, where, holder=obj)))
        elif not isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, type)):
            label = f"{type(obj).__name__} object ({_role(role, 'callable')})"  # __call__'s self
            found.append(((id(obj), "self"), Source(label, where, holder=obj)))
    return found


def _role(role: str, kind: str) -> str:
    return f"{role} {kind}" if role == "the jitted" else role


def describe_callable(obj: Any) -> str:
    """``file:line`` of a callable's code, or its type's name."""
    if isinstance(obj, functools.partial):
        target = obj.func
    else:
        target = obj.__func__ if isinstance(obj, types.MethodType) else obj
    target = getattr(target, "forward", target) if isinstance(target, nn.Module) else target
    code = probe(target, "__code__")  # (an object whose __getattr__ raises KeyError: probe 50)
    if code is not None:
        return f"{code.co_filename}:{code.co_firstlineno}"
    return type(obj).__name__
