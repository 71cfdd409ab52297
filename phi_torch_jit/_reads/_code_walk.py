"""Stage 1 (reads), the static walk: which user code a call can reach, and what it names.

Bytecode is read, nothing is run: the globals and free variables each code object loads
(:func:`names_read`), the attribute and constant-subscript chains it spells out from them
(:func:`attribute_chains`), the user functions reachable from the jitted callable through closures,
globals, classes, bound methods and the user's own modules (:func:`user_functions`); what a
jitted callable holds besides code is :mod:`._held`'s. Only the user's files count
(:mod:`._sources`). See
NOTE [Python reads] and NOTE [attribute paths] in docs/design.md.
"""

from __future__ import annotations

import builtins
import collections
import dis
import functools
import sys
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .._sources import is_user_file
from ._records import PRIMITIVES, Source, Step

__all__ = ["names_read", "attribute_chains", "user_functions", "user_module", "user_class",
           "modules_imported", "names_in_user_code", "callbacks_held", "MAX_DEPTH",
           "added_builtins", "Shadowing", "names_environment"]  # fmt: skip

MAX_FUNCTIONS = 400
"""The walk over user code stops after this many functions."""
MAX_DEPTH = 3
"""How deep attribute paths go (``cfg.solver.tol`` is 2)."""


_LOADS_GLOBAL = frozenset(("LOAD_GLOBAL", "LOAD_NAME"))
_LOADS_CELL = frozenset(("LOAD_DEREF", "LOAD_CLASSDEREF"))
_NAMES: dict[types.CodeType, tuple[dict[str, int], dict[str, int]]] = {}


def names_read(code: types.CodeType) -> tuple[dict[str, int], dict[str, int]]:
    """(globals read -> first line, free variables read -> first line) of one code object and
    the code nested in it (lambdas, comprehensions, generator expressions, inner functions:
    their globals are the function's; their free variables that are the function's own free
    variables are its closure's)."""
    found = _NAMES.get(code)
    if found is None:
        globals_read: dict[str, int] = {}
        cells_read: dict[str, int] = {}
        for inner in _codes(code):
            instructions = list(dis.get_instructions(inner))
            called = {i.argval for i in instructions if i.opname in _LOADS_GLOBAL}
            by_name = "globals" in called  # globals()["G"]: each string constant may name one
            evaluates = not called.isdisjoint(("eval", "exec"))  # eval("ALPHA * 2"): its names
            for instruction in instructions:
                line = instruction.positions.lineno if instruction.positions else None
                name = instruction.argval
                if instruction.opname in _LOADS_GLOBAL:
                    globals_read.setdefault(name, line or inner.co_firstlineno)
                elif instruction.opname == "LOAD_CONST" and isinstance(name, str):
                    named = ((name,) if by_name else ()) + (
                        _names_in_source(name) if evaluates else ()
                    )
                    for each in named:
                        globals_read.setdefault(each, line or inner.co_firstlineno)
                elif instruction.opname in _LOADS_CELL and name in inner.co_freevars:
                    if name in code.co_freevars:
                        cells_read.setdefault(name, line or inner.co_firstlineno)
        found = _NAMES[code] = (globals_read, cells_read)
    return found


_ENVIRONMENT_NAMES = frozenset(("environ", "environb", "getenv", "getenvb", "expandvars",
                                "expanduser", "getuser"))  # fmt: skip
"""Names through which code reads the process environment (``os.environ[...]``,
``os.getenv(...)``, ``from os import environ``, ``os.path.expandvars("$DATA")``,
``expanduser("~")``, ``getpass.getuser()``)."""


def names_environment(code: types.CodeType, names: frozenset[str] = _ENVIRONMENT_NAMES) -> bool:
    """Whether ``code`` or code nested in it (a lambda, a comprehension) names the
    environment (or one of ``names``: ``argv``)."""
    if not names.isdisjoint(code.co_names):
        return True
    return any(
        isinstance(c, types.CodeType) and names_environment(c, names) for c in code.co_consts
    )


def _names_in_source(text: str) -> tuple[str, ...]:
    """The names Python source that ``eval``/``exec`` may run loads (globals among them),
    or none if it is not source."""
    for mode in ("eval", "exec"):
        try:
            code = compile(text, f"<{mode}>", mode)
        except Exception:  # prose, a NUL byte, nesting too deep: no names
            continue
        return tuple(name for inner in _codes(code) for name in inner.co_names)
    return ()


_IMPORTERS = frozenset(("import_module", "__import__", "modules"))
"""Functions that import a module named by a string (``importlib.import_module("settings")``),
and ``sys.modules`` (``sys.modules["settings"]``)."""


def modules_imported(code: types.CodeType) -> dict[str, int]:
    """Modules the code imports while it runs -> first line: ``import settings as s`` inside a
    function, and ``importlib.import_module("settings")`` or ``__import__`` with a constant
    name (each string constant of code that calls one is a candidate; the caller keeps those
    that are modules). Read through a local, so no global or chain names them."""
    found: dict[str, int] = {}
    for inner in _codes(code):
        instructions = list(dis.get_instructions(inner))
        imports = any(i.argval in _IMPORTERS for i in instructions if i.opname in _NAMED_LOADS)
        for instruction in instructions:
            line = instruction.positions.lineno if instruction.positions else None
            if instruction.opname == "IMPORT_NAME":
                found.setdefault(instruction.argval, line or inner.co_firstlineno)
            elif imports and instruction.opname == "LOAD_CONST":
                name = instruction.argval
                if isinstance(name, str) and all(p.isidentifier() for p in name.split(".")):
                    found.setdefault(name, line or inner.co_firstlineno)
    return found


_PYTHONS_BUILTINS = frozenset(vars(builtins))


def added_builtins(name: str) -> dict[str, Any] | None:
    """``builtins``' namespace if ``name`` was set there after Python started (a setting made
    visible to every module); None for Python's own builtins (never rebound) and unknowns."""
    space = vars(builtins)
    return space if name in space and name not in _PYTHONS_BUILTINS else None


class Shadowing:
    """Names a module's code reads as globals that its globals do not define when traced:
    Python's builtins (``round``, ``abs``), names set on ``builtins``, and names defined
    nowhere yet (read under ``try: ... except NameError``, through ``globals().get("K")``,
    ``getattr(settings, "K", 1.0)`` on a module): whether the namespace defines none of them
    still. One defined after the trace (``round = my_round``, ``K = 5.0``) replaces what the
    program baked in."""

    def __init__(self, namespace: dict[str, Any], label: str = "globals") -> None:
        self.namespace = namespace
        self.label = label
        self.names: set[str] = set()

    def source(self) -> Source:
        """Where the guard reads it (True when traced): ``keys().isdisjoint(names)`` of the
        namespace, called through a partial, so that the check is C calls only."""
        label = f"{self.label} not defining {', '.join(sorted(self.names)[:3])}..."
        check = functools.partial(self.namespace.keys().isdisjoint, frozenset(self.names))
        return Source(label, "names undefined when traced", holder=check, path=(_CALL,))


_CALL = Step(True, "__call__", call=True)


_NAMED_LOADS = frozenset(("LOAD_GLOBAL", "LOAD_NAME", "LOAD_ATTR", "LOAD_METHOD"))


def _codes(code: types.CodeType, depth: int = 4) -> list[types.CodeType]:
    """``code`` and the code objects nested in it (a few levels)."""
    found = [code]
    if depth:
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                found += _codes(const, depth - 1)
    return found


def names_used(code: types.CodeType) -> frozenset[str]:
    """The attribute and global names ``code`` and the code nested in it spell."""
    return frozenset(n for inner in _codes(code) for n in inner.co_names)


_CHAINS: dict[types.CodeType, dict[tuple[bool, str], set[tuple[Step, ...]]]] = {}


def attribute_chains(code: types.CodeType) -> dict[tuple[bool, str], set[tuple[Step, ...]]]:
    """Attribute and constant-subscript chains the code reads from each global or free
    variable, ``cfg.solver.tol`` or ``TABLE["solver"]["tol"]``, keyed by (is a cell, name):
    guarded exactly, whatever the budget of the walk over the objects (NOTE [attribute
    paths]). Method loads end a chain (``cfg.update()`` is a call, not data)."""
    found = _CHAINS.get(code)
    if found is not None:
        return found
    found = {}
    for inner in _codes(code):
        _chains_of(inner, code, found)
    _CHAINS[code] = found
    return found


def _chains_of(
    inner: types.CodeType, code: types.CodeType, found: dict[tuple[bool, str], set[Any]]
) -> None:
    """The chains of one code object nested in ``code`` (or ``code`` itself) into ``found``."""
    root: tuple[bool, str] | None = None
    chain: list[Step] = []
    pending_key: Any = _NO_KEY
    for instruction in dis.get_instructions(inner):
        op, arg = instruction.opname, instruction.argval
        free = op in _LOADS_CELL and arg in inner.co_freevars and arg in code.co_freevars
        if op in _LOADS_GLOBAL or free:
            if root is not None and chain:
                found.setdefault(root, set()).add(tuple(chain))
            root, chain, pending_key = (op in _LOADS_CELL, arg), [], _NO_KEY
        elif root is not None and op == "LOAD_METHOD" and arg == "__subclasses__":
            found.setdefault(root, set()).add((*chain, Step(True, arg)))  # a registry: data
            root, chain, pending_key = None, [], _NO_KEY
        elif root is not None and op == "LOAD_ATTR" and isinstance(arg, str):
            chain.append(Step(True, arg))
        elif root is not None and op == "LOAD_CONST" and type(arg) in (str, int):
            pending_key = arg
        elif root is not None and op == "BINARY_SUBSCR" and pending_key is not _NO_KEY:
            chain.append(Step(False, pending_key))
            pending_key = _NO_KEY
        elif root is not None:
            if chain:
                found.setdefault(root, set()).add(tuple(chain))
            root, chain, pending_key = None, [], _NO_KEY
    if root is not None and chain:
        found.setdefault(root, set()).add(tuple(chain))


_NO_KEY = object()


def user_functions(roots: list[Any]) -> Iterator[types.FunctionType]:
    """User functions reachable from ``roots`` through closures, globals read, classes and
    bound methods (a static walk; at most ``MAX_FUNCTIONS``)."""
    pending = list(roots)
    seen: set[int] = set()
    found = 0
    while pending and found < MAX_FUNCTIONS and len(seen) < _MAX_VISITS:
        obj = pending.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if not isinstance(obj, types.FunctionType):
            try:
                pending.extend(_parts(obj))
            except Exception:  # a user __getattr__ raising KeyError: no code found there
                pass
            continue
        if not user_function(obj):
            pending.extend(_wrapped_by(obj))  # @torch.no_grad() on a function of yours
            continue
        found += 1
        yield obj
        for cell in obj.__closure__ or ():
            try:
                pending.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        globals_read, _ = names_read(obj.__code__)
        pending.extend(obj.__globals__[n] for n in globals_read if n in obj.__globals__)
        pending.extend(_through_modules(obj))


def _wrapped_by(function: types.FunctionType) -> list[Any]:
    """What a library's wrapper runs of the user's (a decorator made with ``functools.wraps``:
    ``@torch.no_grad()``, ``@functools.singledispatch``): the function it wraps and, for a
    single-dispatch function, the implementations registered on it."""
    wrapped = function.__dict__.get("__wrapped__")
    if wrapped is None:
        return []
    registry = function.__dict__.get("registry")
    registered = list(registry.values()) if isinstance(registry, Mapping) else []
    return [wrapped, *registered]


def _through_modules(function: types.FunctionType) -> list[Any]:
    """What ``function`` reaches through the user's modules it names (``physics.step``, a
    function of the user's own module, read as an attribute): the end of each chain."""
    found = []
    for (is_cell, name), chains in attribute_chains(function.__code__).items():
        if is_cell or not isinstance(function.__globals__.get(name), types.ModuleType):
            continue
        for chain in chains:
            value = function.__globals__[name]
            for step in chain:
                if not (isinstance(value, types.ModuleType) and user_module(value)):
                    break
                value = getattr(value, step.key, None) if step.attribute else None
            if value is not None and not isinstance(value, types.ModuleType):
                found.append(value)
    return found


def _parts(obj: Any) -> list[Any]:
    """What a non-function object leads to: a method's function and owner, a wrapped
    function, the functions of a user-defined class (for an instance: of its class)."""
    if isinstance(obj, types.MethodType):
        return [obj.__func__, obj.__self__]
    if isinstance(obj, functools.partial):
        return [obj.func, *obj.args, *obj.keywords.values()]
    if isinstance(obj, (types.ModuleType, types.BuiltinFunctionType, *PRIMITIVES)):
        return []
    if type(obj) is collections.defaultdict and obj.default_factory is not None:
        return [obj.default_factory, *obj.values()][:32]  # its factory (a lambda reading state)
    if type(obj) in (list, tuple, dict):  # functions kept in a registry: TERMS = [term], and
        items = obj.values() if type(obj) is dict else obj  # objects whose methods Python
        return [item for item in list(items)[:32] if _may_hold_code(item)]
        # calls for the step (sorted(ITEMS) runs Item.__lt__), nested registries
    wrapped = getattr(obj, "__wrapped__", None) if not isinstance(obj, type) else None
    cls = obj if isinstance(obj, type) else type(obj)
    parts: list[Any] = [wrapped] if wrapped is not None else []
    if isinstance(obj, type) and user_class(type(obj)):  # a metaclass of yours: its __call__
        parts.append(type(obj))
    for klass in cls.__mro__:
        if klass.__module__ in ("builtins",) or not user_class(klass):
            continue
        for member in vars(klass).values():
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            elif isinstance(member, functools.singledispatchmethod):  # what is registered
                parts.append(member.dispatcher)
            elif isinstance(member, property):
                member = member.fget
            if isinstance(member, types.FunctionType):
                parts.append(member)
    if not isinstance(obj, type) and not user_class(cls):  # a library's object: the code of
        for held in callbacks_held(obj).values():  # yours it holds (an integrator's ``rhs``)
            parts += list(held) if type(held) in (list, tuple) else [held]
    elif not isinstance(obj, type) and isinstance(getattr(obj, "__dict__", None), dict):
        held = list(vars(obj).values())[:64]  # an object of yours: functions it holds
        parts += [value for value in held if _may_hold_code(value)]  # (H.fn = helper)
    return parts


def _may_hold_code(value: Any) -> bool:
    """Whether the walk looks into ``value`` for code: a callable, an object of a user class,
    a list, tuple or dict (a registry of registries)."""
    return callable(value) or type(value) in (list, tuple, dict) or _users_code(value)


_MAX_VISITS = 4000
"""Objects the walk for code looks at, at most (nested registries are walked too)."""


def callbacks_held(obj: Any) -> dict[str, Any]:
    """The attributes of a library's object that hold code of the user's: functions, bound
    methods and partials of them, instances of user classes, or a list or tuple with one
    (an integrator's right-hand side, a scheduler's ``lr_lambdas``), by name; the first 64
    attributes (and 32 items) are looked at."""
    try:
        namespace = vars(obj)
    except TypeError:  # no __dict__ (slots, builtins)
        return {}
    found = {}
    for name, value in list(namespace.items())[:64]:
        items = value[:32] if type(value) in (list, tuple) else (value,)  # LambdaLR's list
        if any(_users_code(item) for item in items):
            found[name] = value
    return found


def tensors_held(obj: Any) -> list[str]:
    """The attributes of a library's object that hold tensors (``Normal(loc, scale).loc``),
    by name; the first 64 attributes are looked at."""
    try:
        namespace = vars(obj)
    except TypeError:  # no __dict__ (slots, builtins)
        return []
    return [n for n, v in list(namespace.items())[:64] if isinstance(v, torch.Tensor)]


def _users_code(value: Any) -> bool:
    """Whether ``value`` is a function of the user's, a bound method or partial of one, or an
    instance of a user class."""
    code = value.func if isinstance(value, functools.partial) else value
    code = code.__func__ if isinstance(code, types.MethodType) else code
    if isinstance(code, types.FunctionType):
        return user_function(code)
    return not isinstance(value, type) and user_class(type(value))


def user_class(klass: type) -> bool:
    """Whether a class is the user's: defined in a module of the user's (a file, or a module
    made at run time: ``__main__`` of ``python -c``, a ``types.ModuleType``)."""
    module = sys.modules.get(klass.__module__)
    return module is not None and user_module(module)


def user_function(function: types.FunctionType) -> bool:
    """Whether a function is the user's: from a file of the user's, or compiled from a string
    in a module of the user's (``python -c``, an ``exec`` of the user's: into a bare dict
    too; a dataclass's generated ``__init__``, which calls its ``default_factory``)."""
    filename = function.__code__.co_filename
    if filename != "<string>":  # a file, <stdin> or <console>: the user's; other generated code
        return is_user_file(filename)
    name = function.__module__
    module = sys.modules.get(name) if name is not None else None
    return name is None or (module is not None and user_module(module))


def user_module(module: types.ModuleType) -> bool:
    """Whether a module is the user's: one of the user's files (``import settings``) or made
    at run time (``types.ModuleType("config")``). Its attributes are configuration that the
    code's attribute paths read (``settings.GRAVITY``); libraries' modules are not walked."""
    filename = getattr(module, "__file__", None)
    if isinstance(filename, str):
        return is_user_file(filename)
    made_at_run_time = getattr(module, "__spec__", None) is None
    return made_at_run_time and module.__name__ not in sys.builtin_module_names


_USER_NAMES: dict[type, frozenset[str]] = {}


def names_in_user_code(klass: type) -> frozenset[str]:
    """The attribute names the methods of the user classes in ``klass``'s MRO spell
    (``self._table``): a module's private attributes are the user's state where the user's
    code names them, a library base class's internals (gpytorch's memo caches) otherwise."""
    found = _USER_NAMES.get(klass)
    if found is None:
        names: set[str] = set()
        for base in klass.__mro__:
            if not user_class(base):
                continue
            for member in vars(base).values():
                function = getattr(member, "__func__", member)
                code = getattr(function, "__code__", None)
                if isinstance(code, types.CodeType):
                    for each in _codes(code):  # nested code too (lambdas, comprehensions)
                        names.update(each.co_names)
        found = _USER_NAMES[klass] = frozenset(names)
    return found
