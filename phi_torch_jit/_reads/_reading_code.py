"""Stage 1 (reads): whether code of the user's that answers a read (a property's getter, a
``__getattr__``, a ``__getitem__``) only reads, so that the guard may run it to compare what
it answers (:func:`reads_only`). Code that changes state the guard must never run: a property
advancing a schedule ran seven more times a call (probe round 15)."""

from __future__ import annotations

import builtins
import dis
import types
from typing import Any

from ._code_walk import codes, user_class

__all__ = ["reads_only"]

_WRITES = frozenset(("STORE_ATTR", "STORE_SUBSCR", "STORE_SLICE", "STORE_GLOBAL", "STORE_DEREF",
                     "DELETE_ATTR", "DELETE_SUBSCR", "DELETE_GLOBAL", "DELETE_DEREF",
                     "IMPORT_NAME", "YIELD_VALUE", "RETURN_GENERATOR", "BEFORE_WITH",
                     "SETUP_WITH"))  # fmt: skip
_READING_METHODS = frozenset(("get", "keys", "values", "items", "copy", "index", "count",
                              "startswith", "endswith", "lower", "upper", "strip", "split",
                              "join", "format", "item", "tolist", "size", "dim",
                              "numel"))  # fmt: skip
_READING_BUILTINS = frozenset(
    id(getattr(builtins, n)) for n in ("len", "min", "max", "abs", "float", "int", "bool", "str",
    "round", "sum", "tuple", "list", "dict", "set", "frozenset", "sorted", "isinstance",
    "issubclass", "getattr", "hasattr", "any", "all", "zip", "enumerate", "range", "pow",
    "divmod", "format", "repr", "type", "reversed", "vars", "slice", "complex")
)  # fmt: skip
_READING_MODULES = frozenset(("math", "cmath"))


def reads_only(function: Any) -> bool:
    """Whether ``function``'s code (a property's getter, a ``__getattr__``) only reads: it
    writes no attribute, entry, global or cell, makes no generator, passes no keywords, and
    each call it makes is of a method or builtin that reads (``d.get``, ``len``,
    ``math.sqrt``): it makes no more calls than it loads such callables, so a bound method
    kept in a variable (``pop = self.items.pop; pop()``), ``getattr(self, "_tick")()`` or a
    default argument called do not pass. The guard runs such code to see its value; other
    code it must not run (a property advancing a schedule on each read). Operators on your
    objects (``__float__``, ``__radd__``) are taken to read."""
    if not isinstance(function, types.FunctionType):
        return False
    cells = dict(zip(function.__code__.co_freevars, function.__closure__ or (), strict=False))
    calls = callees = 0
    for code in codes(function.__code__):
        for instruction in dis.get_instructions(code):
            name, value = instruction.opname, instruction.argval
            if name in _WRITES or name == "KW_NAMES":
                return False
            if name.startswith("CALL") and not name.startswith("CALL_INTRINSIC"):
                calls += 1
            elif name == "LOAD_METHOD" or (
                name == "LOAD_ATTR" and "NULL|self" in instruction.argrepr
            ):
                if value not in _READING_METHODS:
                    return False
                callees += 1
            elif name in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF"):
                held = _held(function, cells, name, value)
                if held is _EMPTY or not (callable(held) or isinstance(held, types.ModuleType)):
                    continue  # data
                if not _reads(held):
                    return False
                callees += 1
    return calls <= callees


_EMPTY = object()


def _held(function: types.FunctionType, cells: dict[str, Any], load: str, name: str) -> Any:
    """What a global or free variable ``name`` of ``function`` holds now."""
    if load != "LOAD_DEREF":
        return function.__globals__.get(name, getattr(builtins, name, _EMPTY))
    cell = cells.get(name)
    try:
        return _EMPTY if cell is None else cell.cell_contents
    except ValueError:  # an empty cell
        return _EMPTY


def _reads(value: Any) -> bool:
    """Whether calling ``value`` (or what a module holds) only reads."""
    if isinstance(value, types.ModuleType):
        return value.__name__ in _READING_MODULES
    if not callable(value) or id(value) in _READING_BUILTINS:
        return True
    return isinstance(value, type) and not user_class(value)
