"""Stage 1 (reads): the Python state a specialization depends on, and what it must not touch.

A trace bakes every Python value the function reads: a closure ``dt``, a global config, which
object a global name is. After the record pass, :func:`collect_reads` walks the *user* code the
call can reach -- the function, the functions and classes its closures and globals name, the
methods of the user-defined modules it called (not torch's, ours, the standard library's or an
installed package's) -- and turns the globals and closure variables that code reads into
:class:`Read` records: immutable values are guarded by value, small containers of them by
content, other objects by identity, and tensors become *inputs* of the compiled program, so
reassigning them and updating them in place are both seen. :class:`PythonGuard` checks them
before every compiled call; a changed value retraces, naming the variable, where it is read
and old -> new. The walk is static (bytecode), so the record pass pays nothing for it.

What no compiled program can repeat is noted while the record pass runs by
:mod:`._unguardable`. See NOTE [Python reads] in docs/design.md.
"""

from __future__ import annotations

import collections.abc
import dis
import enum
import functools
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._signature import NAMESPACES
from ._sources import is_user_file

__all__ = [
    "Read",
    "Kind",
    "Source",
    "PythonGuard",
    "collect_reads",
    "same_value",
    "immutable",
    "user_module",
    "describe_callable",
]

_PRIMITIVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_MAX_CONTENT = 32
"""Containers up to this many items (recursively) are guarded by content, larger by identity."""
_MAX_ARRAY = 4096
"""NumPy arrays up to this many elements are guarded by content, larger ones by identity."""
_MAX_FUNCTIONS = 400
_MAX_FIELDS = 64
"""Attribute-path reads under one global or closure object, its whole tree (configs are
small)."""
_MAX_DEPTH = 3
"""How deep attribute paths go (``cfg.solver.tol`` is 2)."""
_GONE = Exception
"""What reading a source may raise: a name or entry gone (KeyError, AttributeError...), or
anything a user object's attribute access raises. Either way the guard fails, and the next
record pass runs the user's code, which raises where eager code would."""
"""The walk over user code stops after this many functions."""


class Kind(enum.Enum):
    """How a read value is guarded."""

    VALUE = "value"
    """Immutable: compared by value."""
    CONTENT = "content"
    """A small container of immutable values: compared by content (a snapshot)."""
    IDENTITY = "identity"
    """Any other object: must be the same object."""
    ARRAY = "array"
    """A NumPy array of up to ``_MAX_ARRAY`` elements: compared by content (a copy)."""
    TENSOR = "tensor"
    """A tensor: an input of the compiled program, guarded by its metadata."""
    ITERATOR = "iterator"
    """An iterator or generator (``next(forcing)``): each call takes new items, which no
    compiled program repeats; a specialization that reads one runs eagerly."""


@dataclass(frozen=True)
class Source:
    """Where a read value lives: a globals dict entry (or a partial's keywords), a closure
    cell, or an object the jitted callable holds (a partial's argument, a method's ``self``,
    the jitted module itself)."""

    label: str
    """``global dt`` or ``closure dt``, for messages."""
    location: str
    """``file:line`` of the first read."""
    namespace: dict[str, Any] | None = None
    """The globals dict (for a global)."""
    name: str = ""
    """The global's name."""
    cell: types.CellType | None = None
    """The cell (for a closure variable)."""
    path: tuple[Step, ...] = ()
    """Attribute and item steps from the global or cell to the value (``cfg.solver.tol``,
    ``TABLE["solver"]["tol"]``): NOTE [attribute paths]."""
    holder: Any = None
    """The object itself, for an object the jitted callable holds (neither a namespace
    entry nor a cell: it cannot be rebound, only changed)."""

    def get(self) -> Any:
        """The current value (KeyError / ValueError / AttributeError if it no longer exists)."""
        value = self._root()
        for step in self.path:
            if step.length:
                value = len(value)
            else:
                value = getattr(value, step.key) if step.attribute else value[step.key]
        return value

    def _root(self) -> Any:
        if self.cell is not None:
            return self.cell.cell_contents
        if self.namespace is not None:
            return self.namespace[self.name]
        return self.holder

    def set(self, value: Any) -> None:
        """Rebind it (used while tracing, to put a traced input in place of a tensor)."""
        if self.path:
            owner = Source(self.label, self.location, self.namespace, self.name, self.cell,
                           self.path[:-1], self.holder).get()  # fmt: skip
            last = self.path[-1]
            if last.attribute:
                setattr(owner, last.key, value)
            else:
                owner[last.key] = value
        elif self.cell is not None:
            self.cell.cell_contents = value
        else:
            assert self.namespace is not None, "an object held by the callable is not rebound"
            self.namespace[self.name] = value

    def child(self, step: Step) -> Source:
        """The source one attribute or item further."""
        if step.length:
            label = f"len({self.label})"
        else:
            label = self.label + (f".{step.key}" if step.attribute else f"[{step.key!r}]")
        return Source(label, self.location, self.namespace, self.name, self.cell,
                      (*self.path, step), self.holder)  # fmt: skip

    def expression(self, root: str) -> str:
        """Python code reading it, given code ``root`` reading the global, cell or object."""
        for step in self.path:
            if step.length:
                root = f"len({root})"
            else:
                root += f".{step.key}" if step.attribute else f"[{step.key!r}]"
        return root


@dataclass(frozen=True)
class Step:
    """One step of an attribute path."""

    attribute: bool
    """``.key`` (True) or ``[key]`` (False)."""
    key: Any
    """An identifier, or a str/int dict key."""
    length: bool = False
    """``len()`` of the value instead (a list's or dict's length: an append is a change)."""


_LENGTH = Step(False, None, length=True)


@dataclass(frozen=True)
class Read:
    """One Python value the function read, and how it is guarded."""

    source: Source
    """Where it lives."""
    kind: Kind
    """How it is compared."""
    expected: Any
    """The value (VALUE), a snapshot (CONTENT), the object (IDENTITY) or the tensor's
    ``(shape, dtype, device, requires_grad)`` (TENSOR)."""

    def current(self) -> Any:
        """What :attr:`expected` is compared with now."""
        value = self.source.get()
        if self.kind is Kind.TENSOR:
            return _tensor_meta(value)
        return value

    def holds(self) -> bool:
        try:
            now = self.current()
        except _GONE:
            return False
        if self.kind in (Kind.IDENTITY, Kind.ITERATOR):
            return now is self.expected
        return same_value(now, self.expected)

    def describe(self) -> str:
        try:
            now = repr(_short(self.current()))
        except _GONE:
            now = "<deleted>"
        where = f"{self.source.label} (read at {self.source.location})"
        return f"{where}: {_short(self.expected)!r} -> {now}"


def _short(value: Any) -> Any:
    text = repr(value)
    return value if len(text) <= 60 else f"<{type(value).__name__} object>"


def _array_copy(value: Any) -> Any:
    return value.copy()


def _same_array(a: Any, b: Any) -> bool:
    numpy = sys.modules["numpy"]
    return (
        type(a) is type(b)
        and a.dtype == b.dtype
        and bool(numpy.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    )


def same_value(a: Any, b: Any) -> bool:
    """Whether a value read now equals the one a trace saw: same type, equal (NaN equals
    NaN, arrays element-wise with their dtype); comparisons that raise are not equal."""
    if hasattr(a, "__array_interface__"):
        return _same_array(a, b)
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # comparisons that raise: not provably equal
        return False


def _tensor_meta(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return ("not a tensor", type(value).__name__)
    return (tuple(value.shape), value.dtype, value.device, value.requires_grad)


def _kind(value: Any) -> Kind | None:
    """How to guard ``value``; None: not worth guarding (modules, builtins)."""
    if isinstance(value, torch.Tensor):
        return Kind.TENSOR
    if isinstance(value, types.ModuleType):
        return Kind.IDENTITY if user_module(value) else None
    if isinstance(value, types.BuiltinFunctionType):
        return None
    if isinstance(value, collections.abc.Iterator):
        return Kind.ITERATOR
    if immutable(value):
        return Kind.VALUE
    if _small_plain(value, _MAX_CONTENT) >= 0:
        return Kind.CONTENT
    if (
        hasattr(value, "__array_interface__")
        and getattr(value, "size", _MAX_ARRAY + 1) <= _MAX_ARRAY
    ):
        return Kind.ARRAY
    return Kind.IDENTITY


def user_module(module: types.ModuleType) -> bool:
    """Whether a module is the user's: one of the user's files (``import settings``) or made
    at run time (``types.ModuleType("config")``). Its attributes are configuration that the
    code's attribute paths read (``settings.GRAVITY``); libraries' modules are not walked."""
    filename = getattr(module, "__file__", None)
    if isinstance(filename, str):
        return is_user_file(filename)
    made_at_run_time = getattr(module, "__spec__", None) is None
    return made_at_run_time and module.__name__ not in sys.builtin_module_names


def immutable(value: Any) -> bool:
    """Whether a value can be guarded by value: numbers, strings, None, enums, dtypes,
    devices, and tuples or frozensets of these."""
    if isinstance(value, _PRIMITIVES) or isinstance(value, enum.Enum):
        return True
    if type(value) in (tuple, frozenset):
        return all(immutable(v) for v in value)
    return False


def _small_plain(value: Any, budget: int) -> int:
    """Budget left after walking a list/dict/set of immutable values; -1 if it is not one."""
    if immutable(value):
        return budget - 1
    if type(value) in (list, set, tuple):
        items = list(value)
    elif type(value) is dict:
        items = [*value.keys(), *value.values()]
    else:
        return -1
    for item in items:
        budget = _small_plain(item, budget)
        if budget < 0:
            return -1
    return budget


def _snapshot(value: Any) -> Any:
    if type(value) is list:
        return [_snapshot(v) for v in value]
    if type(value) is dict:
        return {k: _snapshot(v) for k, v in value.items()}
    if type(value) is set:
        return set(value)
    return value


_LOADS_GLOBAL = frozenset(("LOAD_GLOBAL", "LOAD_NAME"))
_LOADS_CELL = frozenset(("LOAD_DEREF", "LOAD_CLASSDEREF"))
_NAMES: dict[types.CodeType, tuple[dict[str, int], dict[str, int]]] = {}


def _names_read(code: types.CodeType) -> tuple[dict[str, int], dict[str, int]]:
    """(globals read -> first line, free variables read -> first line) of one code object."""
    found = _NAMES.get(code)
    if found is None:
        globals_read: dict[str, int] = {}
        cells_read: dict[str, int] = {}
        for instruction in dis.get_instructions(code):
            line = instruction.positions.lineno if instruction.positions else None
            if instruction.opname in _LOADS_GLOBAL:
                globals_read.setdefault(instruction.argval, line or code.co_firstlineno)
            elif instruction.opname in _LOADS_CELL and instruction.argval in code.co_freevars:
                cells_read.setdefault(instruction.argval, line or code.co_firstlineno)
        found = _NAMES[code] = (globals_read, cells_read)
    return found


_CHAINS: dict[types.CodeType, dict[tuple[bool, str], set[tuple[Step, ...]]]] = {}


def _chains(code: types.CodeType) -> dict[tuple[bool, str], set[tuple[Step, ...]]]:
    """Attribute and constant-subscript chains the code reads from each global or free
    variable, ``cfg.solver.tol`` or ``TABLE["solver"]["tol"]``, keyed by (is a cell, name):
    guarded exactly, whatever the budget of the walk over the objects (NOTE [attribute
    paths]). Method loads end a chain (``cfg.update()`` is a call, not data)."""
    found = _CHAINS.get(code)
    if found is not None:
        return found
    found = {}
    root: tuple[bool, str] | None = None
    chain: list[Step] = []
    pending_key: Any = _NO_KEY
    for instruction in dis.get_instructions(code):
        op, arg = instruction.opname, instruction.argval
        if op in _LOADS_GLOBAL or (op in _LOADS_CELL and arg in code.co_freevars):
            if root is not None and chain:
                found.setdefault(root, set()).add(tuple(chain))
            root, chain, pending_key = (op in _LOADS_CELL, arg), [], _NO_KEY
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
    _CHAINS[code] = found
    return found


_NO_KEY = object()


def _add_chains(
    reads: dict[Any, Read], key: Any, source: Source, chains: set[tuple[Step, ...]]
) -> None:
    """Each prefix of each chain read from ``source``, without descending further: under
    objects guarded by identity only (values and contents are guarded whole), never into a
    module (the module guard and the wrapper own its state)."""
    for chain in chains:
        parent, child = key, source
        for step in chain[: _MAX_DEPTH + 2]:
            above = reads.get(parent)
            if above is None or above.kind is not Kind.IDENTITY:
                break
            if isinstance(above.expected, nn.Module):
                break
            parent, child = (parent, step), child.child(step)
            try:
                value = child.get()
            except _GONE:
                break
            if callable(value) and not isinstance(value, (nn.Module, torch.Tensor)):
                break  # a method or function (a new bound method on every read): code, not data
            _add(reads, parent, child, budget=[0])


def collect_reads(fn: Any, modules: Sequence[nn.Module]) -> list[Read]:
    """The globals and closure variables the user code reachable from ``fn`` and the
    recorded ``modules`` reads, each once (see the module docstring)."""
    reads: dict[Any, Read] = {}
    for module in modules:
        _add_attributes(reads, module)
    for key, source in _held_objects(fn):
        _add(reads, key, source)
        held = source.get()
        if isinstance(held, nn.Module):  # the jitted module, or a method's: its attributes
            for module in held.modules():
                _add_attributes(reads, module)
    for function in _user_functions([fn, *modules]):
        code = function.__code__
        globals_read, cells_read = _names_read(code)
        namespace = function.__globals__
        chains = _chains(code)
        for name, line in globals_read.items():
            if name in namespace:
                source = Source(f"global {name}", f"{code.co_filename}:{line}", namespace, name)
                _add(reads, (id(namespace), name), source)
                _add_chains(reads, (id(namespace), name), source, chains.get((False, name), set()))
        for name, cell in zip(code.co_freevars, function.__closure__ or ()):
            if name in cells_read:
                location = f"{code.co_filename}:{cells_read[name]}"
                source = Source(f"closure {name}", location, cell=cell)
                _add(reads, id(cell), source)
                _add_chains(reads, id(cell), source, chains.get((True, name), set()))
    return list(reads.values())


def _held_objects(fn: Any) -> list[tuple[Any, Source]]:
    """The objects a jitted callable holds besides code: the arguments and keywords of a
    ``functools.partial`` (``partial(relax, cfg=cfg)``), a bound method's ``self``, the
    jitted module itself; their attributes are read through parameters, not names, so they
    are guarded as roots of their own (NOTE [attribute paths])."""
    found: list[tuple[Any, Source]] = []
    pending, seen = [fn], 0
    while pending and seen < _MAX_DEPTH:
        obj, seen = pending.pop(), seen + 1
        where = describe_callable(obj)
        if isinstance(obj, functools.partial):
            for i, value in enumerate(obj.args):
                found.append(((id(obj), i), Source(f"partial argument {i}", where, holder=value)))
            for name in obj.keywords:
                source = Source(f"partial keyword {name}", where, obj.keywords, name)
                found.append(((id(obj), name), source))
            pending.append(obj.func)
        elif isinstance(obj, types.MethodType):
            owner = obj.__self__
            if not isinstance(owner, type):
                label = f"{type(owner).__name__} object (self of {obj.__name__})"
                found.append(((id(owner), "self"), Source(label, where, holder=owner)))
        elif isinstance(obj, nn.Module):
            label = f"{type(obj).__name__} object (the jitted module)"
            found.append(((id(obj), "self"), Source(label, where, holder=obj)))
    return found


def describe_callable(obj: Any) -> str:
    """``file:line`` of a callable's code, or its type's name."""
    target = getattr(obj, "func", None) or getattr(obj, "__func__", None) or obj
    target = getattr(target, "forward", target) if isinstance(target, nn.Module) else target
    code = getattr(target, "__code__", None)
    if code is not None:
        return f"{code.co_filename}:{code.co_firstlineno}"
    return type(obj).__name__


def _add_attributes(reads: dict[Any, Read], module: nn.Module) -> None:
    """Plain attributes of a module that the module guard does not cover: tensors that are
    not buffers (``self.mask = torch.ones(3)``) become inputs; lists, dicts and arrays are
    guarded by content, other objects by identity (immutable values: see ``_guards``)."""
    namespace = module.__dict__
    where = f"{type(module).__qualname__} attributes"
    for name, value in list(namespace.items()):
        if name.startswith("_") or name == "training" or immutable(value):
            continue
        if isinstance(value, nn.Module) or (
            callable(value) and not isinstance(value, torch.Tensor)
        ):
            continue  # submodules: the module guard; methods and functions: not data
        label = f"attribute {type(module).__name__}.{name}"
        _add(reads, (id(namespace), name), Source(label, where, namespace, name))


def _add(reads: dict[Any, Read], key: Any, source: Source, budget: list[int] | None = None) -> None:
    """Add the read of ``source`` and, under an object guarded by identity, its attribute
    paths: ``budget`` (shared by one root's whole tree) bounds how many."""
    if key in reads:
        return
    try:
        value = source.get()
    except _GONE:  # an empty cell: not read after all
        return
    kind = _kind(value)
    if kind is None:
        return
    expected = {Kind.TENSOR: _tensor_meta, Kind.CONTENT: _snapshot, Kind.ARRAY: _array_copy}.get(
        kind, lambda v: v
    )(value)
    reads[key] = Read(source, kind, expected)
    if kind is Kind.IDENTITY and isinstance(value, (list, dict)):  # an append changes it
        _add(reads, (key, _LENGTH), source.child(_LENGTH), budget)
    if kind is Kind.IDENTITY and len(source.path) < _MAX_DEPTH:
        budget = [_MAX_FIELDS] if budget is None else budget
        for step in _fields(value):
            if budget[0] <= 0:
                break
            budget[0] -= 1
            _add(reads, (key, step), source.child(step), budget)


def _fields(value: Any) -> list[Step]:
    """The attribute paths one step under a configuration object (NOTE [attribute paths]):
    public attributes of namespaces and of instances of user classes (dataclasses included;
    class attributes too), public class attributes of user classes, str/int entries of dicts,
    items of lists and tuples (``models[0]``).
    Libraries' objects stay guarded by identity: their internals are not the user's state."""
    if type(value) is dict:
        return [Step(False, k) for k in value if type(k) in (str, int)]
    if type(value) in (list, tuple):
        return [Step(False, i) for i in range(len(value))]
    if isinstance(value, (nn.Module, types.FunctionType, types.MethodType, functools.partial,
                          types.ModuleType)):  # fmt: skip
        return []  # modules: the module guard; functions: code, walked by _user_functions
    if isinstance(value, type):
        klasses = [k for k in value.__mro__ if k is not object and _user_class(k)]
        return [Step(True, n) for n in _class_data(klasses)]
    klass = type(value)
    plain = klass in NAMESPACES or _user_class(klass)  # a library's objects: by identity
    if not plain or not hasattr(value, "__dict__"):
        return []
    names = [n for n in vars(value) if n.isidentifier() and not n.startswith("_")]
    names += [n for n in _class_data([k for k in klass.__mro__ if _user_class(k)])
              if n not in names]  # fmt: skip
    return [Step(True, n) for n in names]


def _class_data(klasses: list[type]) -> list[str]:
    """Public data attributes defined on these classes (no methods, properties, classes)."""
    names: list[str] = []
    for klass in klasses:
        for name, member in vars(klass).items():
            if name.startswith("_") or name in names or not name.isidentifier():
                continue
            if callable(member) or hasattr(type(member), "__get__"):
                continue  # methods, properties, cached properties: reading them runs code
            names.append(name)
    return names


def _user_functions(roots: list[Any]) -> Iterator[types.FunctionType]:
    """User functions reachable from ``roots`` through closures, globals read, classes and
    bound methods (a static walk; at most ``_MAX_FUNCTIONS``)."""
    pending = list(roots)
    seen: set[int] = set()
    found = 0
    while pending and found < _MAX_FUNCTIONS:
        obj = pending.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if not isinstance(obj, types.FunctionType):
            pending.extend(_parts(obj))
            continue
        if not is_user_file(obj.__code__.co_filename):
            continue
        found += 1
        yield obj
        for cell in obj.__closure__ or ():
            try:
                pending.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        globals_read, _ = _names_read(obj.__code__)
        pending.extend(obj.__globals__[n] for n in globals_read if n in obj.__globals__)
        pending.extend(_through_modules(obj))


def _through_modules(function: types.FunctionType) -> list[Any]:
    """What ``function`` reaches through the user's modules it names (``physics.step``, a
    function of the user's own module, read as an attribute): the end of each chain."""
    found = []
    for (is_cell, name), chains in _chains(function.__code__).items():
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
    if isinstance(obj, (types.ModuleType, types.BuiltinFunctionType, *_PRIMITIVES)):
        return []
    wrapped = getattr(obj, "__wrapped__", None) if not isinstance(obj, type) else None
    cls = obj if isinstance(obj, type) else type(obj)
    parts: list[Any] = [wrapped] if wrapped is not None else []
    for klass in cls.__mro__:
        if klass.__module__ in ("builtins",) or not _user_class(klass):
            continue
        for member in vars(klass).values():
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            elif isinstance(member, property):
                member = member.fget
            if isinstance(member, types.FunctionType):
                parts.append(member)
    return parts


def _user_class(klass: type) -> bool:
    module = sys.modules.get(klass.__module__)
    filename = getattr(module, "__file__", None)
    return isinstance(filename, str) and is_user_file(filename)


def _fetcher(sources: list[Source]) -> Callable[[], list[Any]]:
    """A function returning the current values of ``sources`` as one list display: the
    namespaces and cells are its default arguments (fast locals), the names literals."""
    params, items = [], []
    for i, source in enumerate(sources):
        if source.cell is not None:
            params.append(f"c{i}=__sources[{i}].cell")
            items.append(source.expression(f"c{i}.cell_contents"))
        elif source.namespace is None:
            params.append(f"h{i}=__sources[{i}].holder")
            items.append(source.expression(f"h{i}"))
        else:
            params.append(f"n{i}=__sources[{i}].namespace")
            items.append(source.expression(f"n{i}[{source.name!r}]"))
    text = f"def fetch({', '.join(params)}):\n    return [{', '.join(items)}]\n"
    scope: dict[str, Any] = {"__sources": sources}
    exec(compile(text, "<phi_torch_jit guard>", "exec"), scope)
    return scope["fetch"]  # type: ignore[no-any-return]


class PythonGuard:
    """Checks before each compiled call that the Python values a trace baked are unchanged.

    Built for speed (read before every call): the current values are fetched by one list
    comprehension over (namespace, name) and cell pairs, then compared in three slices --
    values and contents with ``==`` (and their types), objects by ``id`` (the expected objects
    are held, so their ids cannot be reused), tensors by metadata.
    """

    def __init__(self, reads: list[Read]) -> None:
        order = {Kind.VALUE: 0, Kind.CONTENT: 0, Kind.IDENTITY: 1, Kind.ITERATOR: 1,
                 Kind.ARRAY: 2, Kind.TENSOR: 3}  # fmt: skip
        self.reads = tuple(sorted(reads, key=lambda r: order[r.kind]))
        """Every guarded read: values and contents, then identities, then tensors."""
        self.tensors = tuple(r for r in self.reads if r.kind is Kind.TENSOR)
        """Tensors read from globals and closures: inputs of the compiled program."""
        counts = [sum(order[r.kind] == k for r in self.reads) for k in (0, 1, 2)]
        self._n_values, self._n_ids, self._n_arrays = counts
        start = self._n_values + self._n_ids
        self._arrays = [r.expected for r in self.reads[start : start + self._n_arrays]]
        values = self.reads[: self._n_values]
        self._values = [r.expected for r in values]
        self._types = [type(r.expected) for r in values]
        self._ids = [
            id(r.expected) for r in self.reads[self._n_values : self._n_values + self._n_ids]
        ]
        self._metas = [r.expected for r in self.tensors]
        self._current = _fetcher([r.source for r in self.reads])

    def holds(self) -> bool:
        """Whether every read value is still what the trace saw."""
        try:
            now = self._current()
        except _GONE:  # a global deleted, a cell emptied, an attribute or entry removed
            return False
        n, m = self._n_values, self._n_values + self._n_ids
        values = now[:n]
        if values != self._values or list(map(type, values)) != self._types:
            return False
        if list(map(id, now[n:m])) != self._ids:
            return False
        k = m + self._n_arrays
        if not all(map(_same_array, now[m:k], self._arrays)):
            return False
        return list(map(_tensor_meta, now[k:])) == self._metas

    def captured(self) -> list[torch.Tensor]:
        """The current values of the captured tensors, in input order."""
        return [r.source.get() for r in self.tensors]

    def describe_change(self) -> str:
        """The first read that changed, e.g. ``closure dt (read at f.py:3): 0.1 -> 0.2``."""
        for read in self.reads:
            if not read.holds():
                return read.describe()
        return "nothing"

    def __len__(self) -> int:
        return len(self.reads)
