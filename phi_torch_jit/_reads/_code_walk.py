"""Stage 1 (reads), the static walk: which user code a call can reach, and what it names.

Bytecode is read, nothing is run: the globals and free variables each code object loads
(:func:`names_read`), the attribute and constant-subscript chains it spells out from them
(:func:`attribute_chains`), the globals it may look up by a name held in a variable
(:func:`names_looked_up`), and what is the user's (:func:`user_function`, :func:`user_class`,
:func:`user_module`; only the user's files count, :mod:`._sources`). Which functions a call
reaches is :mod:`._reachable`'s; what a jitted callable holds besides code is :mod:`._held`'s. See
NOTE [Python reads] and NOTE [attribute paths] in docs/design.md.
"""

from __future__ import annotations

import builtins
import dis
import functools
import itertools
import sys
import types
from typing import Any

from .._sources import TYPED_IN, is_user_file, user_module
from ._records import Source, Step

__all__ = ["names_read", "attribute_chains", "user_module", "codes", "user_class",
           "user_function", "modules_imported", "IMPORTERS", "names_in_user_code", "MAX_DEPTH",
           "added_builtins", "Shadowing", "names_looked_up",
           "values_read", "first_items", "iterates_globals", "method_chains",
           "chains_spelled"]  # fmt: skip

MAX_DEPTH = 3
"""How deep attribute paths go (``cfg.solver.tol`` is 2)."""


_LOADS_GLOBAL = frozenset(("LOAD_GLOBAL", "LOAD_NAME"))
_LOADS_CELL = frozenset(("LOAD_DEREF", "LOAD_CLASSDEREF"))
_STORES_GLOBAL = frozenset(("STORE_GLOBAL", "DELETE_GLOBAL"))
_CELLS = _LOADS_CELL | {"STORE_DEREF", "DELETE_DEREF"}
"""A global or free variable the code only stores (``global LAST; LAST = y.detach()``) is
state it changes: read with the others, so the record pass sees the change (compiled calls
would skip the store)."""
_NAMES: dict[types.CodeType, tuple[dict[str, int], dict[str, int]]] = {}


def names_read(code: types.CodeType) -> tuple[dict[str, int], dict[str, int]]:
    """(globals read or written -> first line, free variables read or written -> first line)
    of one code object and the code nested in it (lambdas, comprehensions, generator
    expressions, inner functions: their globals are the function's; their free variables that
    are the function's own free variables are its closure's)."""
    found = _NAMES.get(code)
    if found is None:
        globals_read: dict[str, int] = {}
        cells_read: dict[str, int] = {}
        for inner in codes(code):
            instructions = list(dis.get_instructions(inner))
            called = {i.argval for i in instructions if i.opname in _LOADS_GLOBAL}
            by_name = _looks_up(inner)  # globals()["G"]: each string constant may name one
            evaluates = not called.isdisjoint(("eval", "exec"))  # eval("ALPHA * 2"): its names
            for instruction in instructions:
                line = instruction.positions.lineno if instruction.positions else None
                name = instruction.argval
                if instruction.opname in _LOADS_GLOBAL or instruction.opname in _STORES_GLOBAL:
                    globals_read.setdefault(name, line or inner.co_firstlineno)
                elif instruction.opname == "LOAD_CONST" and isinstance(name, str):
                    named = ((name,) if by_name else ()) + (
                        _names_in_source(name) if evaluates else ()
                    )
                    for each in named:
                        globals_read.setdefault(each, line or inner.co_firstlineno)
                elif instruction.opname in _CELLS and name in inner.co_freevars:
                    if name in code.co_freevars:
                        cells_read.setdefault(name, line or inner.co_firstlineno)
        found = _NAMES[code] = (globals_read, cells_read)
    return found


_BY_NAME = frozenset(("vars", "__dict__", "getattr", "setattr", "delattr", "hasattr"))


def _looks_up(code: types.CodeType) -> bool:
    """Whether ``code`` itself looks globals up by name: ``globals()``, ``builtins.globals()``,
    ``vars(sys.modules[__name__])``, ``sys.modules[__name__].__dict__``,
    ``setattr(sys.modules[__name__], "LAST", y)``, through its own frame
    (``sys._getframe(0).f_globals["K"]``, ``inspect.currentframe().f_globals``: probe 47)."""
    names = code.co_names
    if "globals" in names or "f_globals" in names:
        return True
    return "modules" in names and not _BY_NAME.isdisjoint(names)


def values_read(function: types.FunctionType) -> list[Any]:
    """The current values of the globals and closure variables ``function``'s code reads."""
    globals_read, cells_read = names_read(function.__code__)
    values = [function.__globals__[n] for n in globals_read if n in function.__globals__]
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
        if name in cells_read:
            try:
                values.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
    return values


def names_looked_up(function: types.FunctionType) -> frozenset[str]:
    """Globals ``function`` may look up by a name held in a variable (``globals()[WHICH]``,
    ``globals()[NAMES[0]]``; ``globals`` called under another name: ``GL = globals``): each
    string that a global or closure variable it reads holds, or a small container of them
    holds, and, with ``globals`` renamed, each string constant. Those variables are guarded
    by value, so another name retraces and reads anew."""
    code = function.__code__
    values = values_read(function)
    renamed = any(value is builtins.globals for value in values)
    if not renamed and not any(map(_looks_up, codes(code))):
        return frozenset()
    found: set[str] = set()
    for value in values:
        items = value if isinstance(value, (list, tuple, set, frozenset)) else (value,)
        if isinstance(value, dict):
            items = (*first_items(value, 64), *first_items(value.values(), 64))
        found.update(v for v in first_items(items, 64) if isinstance(v, str))
    if renamed:
        found.update(c for inner in codes(code) for c in inner.co_consts if isinstance(c, str))
    if iterates_globals(function):  # for name, value in globals().items(): each of them
        found.update(n for n in first_items(function.__globals__, _MAX_LISTED) if not _dunder(n))
    return frozenset(n for n in found if n.isidentifier())


_MAX_LISTED = 512
"""Globals read by code that iterates over the module's globals (``globals().items()``)."""
_LISTING = frozenset(("items", "values", "keys", "copy"))


def iterates_globals(function: types.FunctionType) -> bool:
    """Whether ``function``'s code may iterate over its module's globals (``for name, value
    in globals().items()``, ``for n in globals()``; a loop beside ``globals()[WHICH]`` counts
    too): every global is then read, and how many there are."""
    for inner in codes(function.__code__):
        if not _looks_up(inner):
            continue
        if not _LISTING.isdisjoint(inner.co_names):
            return True
        if any(i.opname == "GET_ITER" for i in dis.get_instructions(inner)):
            return True
    return False


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def first_items(items: Any, n: int) -> list[Any]:
    """Up to ``n`` items of a container of any class (a library's tuple subclass may refuse
    ``len()``, which ``list()`` asks: e3nn's ``Irreps``)."""
    try:
        return list(itertools.islice(iter(items), n))
    except Exception:  # its own iteration rules
        return []


def _names_in_source(text: str) -> tuple[str, ...]:
    """The names Python source that ``eval``/``exec`` may run loads (globals among them),
    or none if it is not source."""
    for mode in ("eval", "exec"):
        try:
            code = compile(text, f"<{mode}>", mode)
        except Exception:  # prose, a NUL byte, nesting too deep: no names
            continue
        return tuple(name for inner in codes(code) for name in inner.co_names)
    return ()


IMPORTERS = frozenset(("import_module", "__import__", "modules"))
"""Functions that import a module named by a string (``importlib.import_module("settings")``),
and ``sys.modules`` (``sys.modules["settings"]``)."""


def modules_imported(code: types.CodeType) -> dict[str, int]:
    """Modules the code imports while it runs -> first line: ``import settings as s`` inside a
    function, and ``importlib.import_module("settings")`` or ``__import__`` with a constant
    name (each string constant of code that calls one is a candidate; the caller keeps those
    that are modules). Read through a local, so no global or chain names them."""
    found: dict[str, int] = {}
    for inner in codes(code):
        instructions = list(dis.get_instructions(inner))
        imports = any(i.argval in IMPORTERS for i in instructions if i.opname in _NAMED_LOADS)
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


def codes(code: types.CodeType, depth: int = 4) -> list[types.CodeType]:
    """``code`` and the code objects nested in it (a few levels)."""
    found = [code]
    if depth:
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                found += codes(const, depth - 1)
    return found


def names_used(code: types.CodeType) -> frozenset[str]:
    """The attribute and global names ``code`` and the code nested in it spell."""
    return frozenset(n for inner in codes(code) for n in inner.co_names)


_CHAINS: dict[types.CodeType, dict[tuple[bool, str], set[tuple[Step, ...]]]] = {}
_METHODS: dict[types.CodeType, dict[tuple[bool, str], set[tuple[Step, ...]]]] = {}
_SPELLED: dict[types.CodeType, dict[tuple[bool, str], set[tuple[Step, ...]]]] = {}


def attribute_chains(code: types.CodeType) -> dict[tuple[bool, str], set[tuple[Step, ...]]]:
    """Attribute and constant-subscript chains the code reads from each global or free
    variable, ``cfg.solver.tol`` or ``TABLE["solver"]["tol"]``, keyed by (is a cell, name):
    guarded exactly, whatever the budget of the walk over the objects (NOTE [attribute
    paths]). Method loads end a chain (``cfg.update()`` is a call, not data)."""
    found = _CHAINS.get(code)
    if found is not None:
        return found
    found = {}
    methods: dict[tuple[bool, str], set[tuple[Step, ...]]] = {}
    for inner in codes(code):
        _chains_of(inner, code, found, methods)
    _CHAINS[code], _METHODS[code] = found, methods
    return found


def method_chains(code: types.CodeType) -> dict[tuple[bool, str], set[tuple[Step, ...]]]:
    """Chains as :func:`attribute_chains`'s that end in a method load, the method their
    last step: ``torch.get_num_threads()``, ``torch.backends.mkldnn.is_available()`` (what
    the code calls of a library's module: :mod:`._library_state`)."""
    attribute_chains(code)
    return _METHODS[code]


def chains_spelled(code: types.CodeType) -> dict[tuple[bool, str], set[tuple[Step, ...]]]:
    """:func:`attribute_chains` and :func:`method_chains` together: the reads and the calls
    (``K.backend.get_num_threads()``: a library's module held by a class, NOTE [libraries'
    settings])."""
    merged = _SPELLED.get(code)
    if merged is None:
        merged = {k: set(v) for k, v in attribute_chains(code).items()}
        for k, v in method_chains(code).items():
            merged.setdefault(k, set()).update(v)
        _SPELLED[code] = merged
    return merged


def _chains_of(
    inner: types.CodeType, code: types.CodeType, found: dict[tuple[bool, str], set[Any]],
    methods: dict[tuple[bool, str], set[Any]],
) -> None:  # fmt: skip
    """The chains of one code object nested in ``code`` (or ``code`` itself) into ``found``,
    and those ending in a method load into ``methods``."""
    root: tuple[bool, str] | None = None
    chain: list[Step] = []
    pending_key: Any = _NO_KEY
    via_getattr = False  # getattr(torch.backends.mkldnn, "enabled"): a literal name
    for instruction in dis.get_instructions(inner):
        op, arg = instruction.opname, instruction.argval
        free = op in _LOADS_CELL and arg in inner.co_freevars and arg in code.co_freevars
        if op in _LOADS_GLOBAL or free:
            if root is not None and chain:
                found.setdefault(root, set()).add(tuple(chain))
            via_getattr = root == (False, "getattr") and not chain
            root, chain, pending_key = (op in _LOADS_CELL, arg), [], _NO_KEY
        elif via_getattr and root is not None and op in _CALLS and instruction.arg == 2:
            if isinstance(pending_key, str) and pending_key.isidentifier():
                found.setdefault(root, set()).add((*chain, Step(True, pending_key)))
            root, chain, pending_key, via_getattr = None, [], _NO_KEY, False
        elif root is not None and op == "LOAD_METHOD" and arg == "__subclasses__":
            found.setdefault(root, set()).add((*chain, Step(True, arg)))  # a registry: data
            root, chain, pending_key = None, [], _NO_KEY
        elif root is not None and op == "LOAD_METHOD" and isinstance(arg, str):
            methods.setdefault(root, set()).add((*chain, Step(True, arg)))
            if chain:
                found.setdefault(root, set()).add(tuple(chain))
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
            root, chain, pending_key, via_getattr = None, [], _NO_KEY, False
    if root is not None and chain:
        found.setdefault(root, set()).add(tuple(chain))


_NO_KEY = object()
_CALLS = frozenset(("PRECALL", "CALL", "CALL_FUNCTION"))
"""The instruction that calls with ``arg`` arguments (3.11: PRECALL then CALL; 3.12+: CALL)."""


def user_class(klass: type) -> bool:
    """Whether a class is the user's: defined in a module of the user's (a file, or a module
    made at run time: ``__main__`` of ``python -c``, a ``types.ModuleType``)."""
    module = sys.modules.get(klass.__module__)
    return module is not None and user_module(module)


def user_function(function: types.FunctionType) -> bool:
    """Whether a function is the user's: from a file of the user's, or compiled from a string
    (``<string>``, ``<generated>``...) in a module of the user's (``python -c``, a dataclass's
    generated ``__init__``, which calls its ``default_factory``) or into a namespace that is no
    module's (an ``exec`` of the user's into a dict of its own, whatever its ``__name__``:
    generated code, a symbolic library's generated function). Code typed at a prompt is the
    user's; torch's generated code (FX's ``<eval_with_key>``) and ours are not."""
    filename = function.__code__.co_filename
    if not filename.startswith("<") or filename.startswith(_NOT_GENERATED_BY_USERS):
        return is_user_file(filename)
    name = function.__module__
    module = sys.modules.get(name) if isinstance(name, str) else None
    if module is None or getattr(module, "__dict__", None) is not function.__globals__:
        return True  # its own namespace, made by an exec
    return user_module(module)


_NOT_GENERATED_BY_USERS = (*TYPED_IN, "<frozen ", "<eval_with_key>", "<phi_torch_jit ")
"""Names of code that :func:`is_user_file` decides: typed at a prompt (the user's), or made by
the interpreter, torch's FX or us."""


_USER_NAMES: dict[type, frozenset[str]] = {}


def names_in_user_code(klass: type) -> frozenset[str]:
    """The attribute names the methods of the user classes in ``klass``'s MRO spell
    (``self._table``, or as a string: ``self.__dict__["_cfg"]``, ``getattr(self, "_cfg")``,
    probe 40c): a module's private attributes are the user's state where the user's code
    names them, a library base class's internals (gpytorch's memo caches) otherwise."""
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
                    for each in codes(code):  # nested code too (lambdas, comprehensions)
                        names.update(each.co_names)
                        names.update(c for c in each.co_consts if type(c) is str)
        found = _USER_NAMES[klass] = frozenset(names)
    return found
