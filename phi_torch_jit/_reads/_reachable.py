"""Stage 1 (reads), the static walk's reach: the user functions a call can reach from the
jitted callable (:func:`user_functions`) through closures, globals read (also by a name held in
a variable, :func:`._code_walk.names_looked_up`), containers, classes, bound methods, partials,
the user's own modules and the code of the user's that a library's object holds
(:func:`callbacks_held`). Nothing is run. See NOTE [Python reads] in docs/design.md.
"""

from __future__ import annotations

import builtins
import collections
import contextvars
import datetime
import functools
import gc
import itertools
import types
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ._callable_attributes import attribute_values
from ._class_registries import ctypes_held, registered_for
from ._code_walk import (
    chains_spelled,
    names_looked_up,
    names_read,
    user_class,
    user_function,
    user_module,
)
from ._records import PRIMITIVES, probe

__all__ = [
    "user_functions",
    "reach",
    "Reach",
    "methods_set_on_tensors",
    "holds_users_code",
    "callbacks_held",
    "tensors_held",
    "wrapper_cells",
    "CONTAINERS",
    "MAX_ITEMS",
    "MAX_FUNCTIONS",
    "MAX_VISITS",
]

_OPAQUE = frozenset(("functools", "operator", "numpy"))
"""Modules whose C callables hide what they hold (``functools.cmp_to_key(mycmp)``, an
``operator.methodcaller``'s arguments, ``numpy.frompyfunc(f, 1, 1)``): what they hold is
read as the garbage collector sees it."""

MAX_FUNCTIONS = 400
"""The walk over user code stops after this many functions."""


@dataclass(frozen=True)
class Reach:
    """What the walk over user code found (:func:`reach`)."""

    functions: list[types.FunctionType]
    """The user functions, nearest first."""
    left: int
    """Objects that may hold code it did not look at, having met its limits
    (:data:`MAX_FUNCTIONS` functions, :data:`MAX_VISITS` objects): 0 where it walked all."""

    def said(self) -> str:
        """What is not guarded, for ``explain()`` and the trace's log."""
        return (
            f"calls past the walk's limits (it walks at most {MAX_FUNCTIONS} functions and "
            f"{MAX_VISITS} objects)"
        )


def user_functions(roots: list[Any]) -> Iterator[types.FunctionType]:
    """User functions reachable from ``roots`` through closures, globals read, classes and
    bound methods (a static walk; at most ``MAX_FUNCTIONS``), nearest first."""
    return iter(reach(roots).functions)


def reach(roots: list[Any]) -> Reach:
    """The walk of :func:`user_functions`, breadth first: what the step names itself (a
    helper, a registry's first entries) comes before what lies deeper in its data, so the
    limits leave out the far end. Walked depth first, a nested table read after a helper
    (64x64 lists of number pairs) used up the objects the walk looks at before the helper was
    reached, and a registry of 400 lambdas its first entries, both silently (probe round 35);
    where the limits are met, :attr:`Reach.left` says so."""
    pending = collections.deque(roots)
    seen: set[int] = set()
    found: list[types.FunctionType] = []
    while pending and len(found) < MAX_FUNCTIONS and len(seen) < MAX_VISITS:
        obj = pending.popleft()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if type(obj) is not types.FunctionType:  # (an object may not answer __class__)
            try:
                pending.extend(_parts(obj))
            except Exception:  # a user __getattr__ raising KeyError: no code found there
                pass
            continue
        if not user_function(obj):
            pending.extend(_wrapped_by(obj))  # @torch.no_grad() on a function of yours
            continue
        found.append(obj)
        pending.extend(obj.__defaults__ or ())  # def f(x, op=lambda t: t * K): its code
        pending.extend((obj.__kwdefaults__ or {}).values())
        pending.extend(list(obj.__dict__.values())[:64])  # f.__wrapped__ = g: what a library
        for cell in obj.__closure__ or ():  # reaches through it (inspect.unwrap: probe 48)
            try:
                pending.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        globals_read, _ = names_read(obj.__code__)
        pending.extend(obj.__globals__[n] for n in globals_read if n in obj.__globals__)
        pending.extend(_set_on_builtins(obj, globals_read))
        pending.extend(obj.__globals__[n] for n in names_looked_up(obj) if n in obj.__globals__)
        pending.extend(_through_modules(obj))
        pending.extend(methods_set_on_tensors(obj.__code__).values())
    return Reach(found, len({id(p) for p in pending if _may_hold_code(p)} - seen))


def _set_on_builtins(function: types.FunctionType, names: Iterable[str]) -> list[Any]:
    """Code of yours that ``function`` finds by a name on its builtins, not its globals
    (``builtins.SCALE = scale`` by a setup module, then ``SCALE(x)``): walked like a global's
    (probe 38c)."""
    found = getattr(function, "__builtins__", builtins)  # a dict (a module in __main__'s)
    space = found if isinstance(found, dict) else vars(found)
    scope = function.__globals__
    return [space[n] for n in names if n not in scope and n in space and _users_code(space[n])]


def methods_set_on_tensors(code: types.CodeType) -> dict[str, types.FunctionType]:
    """Functions of yours set on ``torch.Tensor`` (``torch.Tensor.scaled = scaled``) under
    the names ``code`` spells (``x.scaled()``), by name."""
    tensor = vars(torch.Tensor)
    found = {}
    for name in code.co_names:
        method = tensor.get(name)
        if isinstance(method, types.FunctionType) and user_function(method):
            found[name] = method
    return found


def _wrapped_by(function: types.FunctionType) -> list[Any]:
    """What a library's wrapper runs of the user's (a decorator made with ``functools.wraps``:
    ``@torch.no_grad()``, ``@functools.singledispatch``): the function it wraps and, for a
    single-dispatch function, the implementations registered on it."""
    wrapped = function.__dict__.get("__wrapped__")
    if wrapped is None:
        return []
    registry = function.__dict__.get("registry")
    registered = list(registry.values()) if isinstance(registry, Mapping) else []
    return [wrapped, *registered, *wrapper_cells(function).values()]


def wrapper_cells(function: types.FunctionType) -> dict[str, Any]:
    """What a library's wrapper (a function with ``__wrapped__``) holds in its closure besides
    the function it wraps: the context manager of a ``ContextDecorator`` (``@Scaled(k)``, a
    ``@contextmanager`` used as a decorator) runs around the wrapped function."""
    held = {}
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or (), strict=False):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if not isinstance(value, (types.FunctionType, *PRIMITIVES)):
            held[name] = value
    return held


def _through_modules(function: types.FunctionType) -> list[Any]:
    """What ``function`` reaches through the user's modules it names (``physics.step``, a
    function of the user's own module, read as an attribute): the end of each chain; through
    a library's module, only code of the user's set on it (``F.my_act = my_act``)."""
    found = []
    for (is_cell, name), chains in chains_spelled(function.__code__).items():
        if is_cell or not _is_module(function.__globals__.get(name)):
            continue
        for chain in chains:
            value, yours = function.__globals__[name], True
            for step in chain:
                if not _is_module(value):
                    break
                yours = yours and user_module(value)
                value = getattr(value, step.key, None) if step.attribute else None
            if value is None or _is_module(value):
                continue
            if yours or holds_users_code(value):  # F.my_act = my_act, torch.OPS = {...}: code
                found.append(value)  # of yours kept on a library's module
    return found


def _is_module(value: Any) -> bool:
    """``isinstance(value, ModuleType)`` without asking ``value`` for its ``__class__``, which
    an object of yours answering every attribute from a table may not have (probe 46:
    ``__getattribute__`` raising KeyError crashed the walk)."""
    return issubclass(type(value), types.ModuleType)


def holds_users_code(value: Any) -> bool:
    """Whether ``value`` is code or an object of the user's, or a container holding some."""
    if _users_code(value):
        return True
    return isinstance(value, CONTAINERS) and any(_users_code(i) for i in _held_items(value))


def _parts(obj: Any) -> list[Any]:
    """What a non-function object leads to: a method's function and owner, a wrapped
    function, the functions of a user-defined class (for an instance: of its class)."""
    if isinstance(obj, types.MethodType):
        return [obj.__func__, obj.__self__]
    if isinstance(obj, functools.partial):  # and functions set on it (P.post = post)
        return [obj.func, *obj.args, *obj.keywords.values(), *attribute_values(obj)]
    if isinstance(obj, (types.BuiltinFunctionType, types.MethodWrapperType)):
        # a C method held bound (LOOK = TABLE.__getitem__): its object, whose class may run
        # code of yours (Table.__missing__); a module's C function: nothing
        owner = getattr(obj, "__self__", None)
        return [] if owner is None or isinstance(owner, types.ModuleType) else [owner]
    if isinstance(obj, (types.ModuleType, *PRIMITIVES)):
        return []
    if isinstance(obj, _HOLDERS):
        return _referred(obj)
    if type(obj).__module__ in _OPAQUE and not isinstance(obj, type) and callable(obj):
        return [p for p in gc.get_referents(obj) if not isinstance(p, type)]
    if isinstance(obj, _TIMES):  # C calls its tzinfo's utcoffset() (probe 48)
        return [obj.tzinfo] if obj.tzinfo is not None else []
    parts: list[Any] = ctypes_held(obj)  # a callback C calls, a structure's callbacks
    if isinstance(obj, type) and user_class(obj):  # code a library keeps for your class
        parts += registered_for(obj)  # (a pytree node's flatten, a KL divergence)
    if isinstance(obj, CONTAINERS):  # functions kept in a registry: TERMS = [term], and
        parts += _held_items(obj)  # objects whose methods Python calls for the step
        if not user_class(type(obj)):  # (sorted(ITEMS) runs Item.__lt__), nested registries
            return parts  # a list subclass of yours: its methods too
    wrapped = probe(obj, "__wrapped__") if not isinstance(obj, type) else None
    cls = obj if isinstance(obj, type) else type(obj)
    parts += [wrapped] if wrapped is not None else []
    if isinstance(obj, type) and user_class(type(obj)):  # a metaclass of yours: its __call__
        parts.append(type(obj))
    for klass in cls.__mro__:
        if klass.__module__ in ("builtins",) or not user_class(klass):
            continue
        for name, member in vars(klass).items():
            if isinstance(member, (staticmethod, classmethod)):
                parts += attribute_values(member)  # SM.post = post, set on the object
                member = member.__func__
            elif isinstance(member, functools.singledispatchmethod):  # what is registered
                parts.append(member.dispatcher)
            elif isinstance(member, property):
                member = member.fget
            if isinstance(member, types.FunctionType):
                parts.append(member)
            elif not name.startswith("__") and _may_hold_code(member):  # a partial, a table
                parts.append(member)  # of lambdas, a callable object kept on the class
    if not isinstance(obj, type) and user_class(cls):  # its classes, as above (each once)
        parts += [k for k in cls.__mro__ if user_class(k)]
    if not isinstance(obj, type) and not user_class(cls):  # a library's object: the code of
        for held in callbacks_held(obj).values():  # yours it holds (an integrator's ``rhs``)
            parts += list(held) if type(held) in (list, tuple, collections.deque) else [held]
    elif not isinstance(obj, type):  # an object of yours: functions it holds (H.fn =
        held = list(vars(obj).values())[:64] if isinstance(probe(obj, "__dict__"), dict) else []
        held += _slot_values(cls, obj)  # helper), in its __dict__ or its slots (probe 44a)
        parts += [value for value in held if _may_hold_code(value)]
    return parts


def _slot_values(cls: type, obj: Any) -> list[Any]:
    """What the slots of ``obj``'s classes of yours hold (unset ones left out)."""
    found = []
    for klass in cls.__mro__:
        slots = vars(klass).get("__slots__", ()) if user_class(klass) else ()
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__"):
                value = probe(obj, name, _UNSET)
                found += [] if value is _UNSET else [value]
    return found[:64]


_UNSET = object()


_HOLDERS: tuple[type, ...] = (weakref.ref, weakref.ProxyType, weakref.CallableProxyType,
                              contextvars.ContextVar, types.MappingProxyType,
                              collections.ChainMap, weakref.WeakValueDictionary,
                              functools.partialmethod, weakref.finalize)  # fmt: skip
"""Objects that hold another without being a container the walk opens: what a step calls
through them (``REF()(x)``, ``VAR.get()(x)``, ``TABLE["f"](x)`` with a read-only view as
``TABLE``, a property of an object behind a proxy) is code of the step's (probe 38a)."""


def _referred(holder: Any) -> list[Any]:
    """What a :data:`_HOLDERS` object holds now: a weak reference's object (none if it died),
    a proxy's class and attributes (a proxy forwards them; its object cannot be had), a
    context variable's value in this context (or its default), a mapping view's values, a
    chain's maps, what a ``partialmethod`` or a ``weakref.finalize`` calls and binds."""
    if isinstance(holder, weakref.ref):
        held = holder()
        return [] if held is None else [held]
    if isinstance(holder, (weakref.ProxyType, weakref.CallableProxyType)):
        try:
            namespace = holder.__dict__
        except (ReferenceError, AttributeError):  # dead, or an object without a __dict__
            namespace = {}
        try:
            return [holder.__class__, *list(namespace.values())[:64]]
        except ReferenceError:
            return []
    if isinstance(holder, contextvars.ContextVar):
        try:
            return [holder.get()]  # (get(default) would pass over the variable's default)
        except LookupError:  # neither set in this context nor made with a default
            return []
    if isinstance(holder, collections.ChainMap):
        return list(holder.maps)
    if isinstance(holder, functools.partialmethod):  # a class's m = partialmethod(f, k=2)
        return [holder.func, *holder.args, *holder.keywords.values()]
    if isinstance(holder, weakref.finalize):  # FIN.peek(): its object, function, arguments
        held = holder.peek()
        return [] if held is None else [held[0], held[1], *held[2], *held[3].values()]
    return _held_items(dict(holder.items()))  # a mapping view, a dict of weak values


def _may_hold_code(value: Any) -> bool:
    """Whether the walk looks into ``value`` for code: a callable, an object of a user class,
    a container (a registry of registries), a holder (:data:`_HOLDERS`)."""
    return (
        callable(value)
        or isinstance(value, (*CONTAINERS, *_HOLDERS))
        or _users_code(value)
        or (isinstance(value, torch.Tensor) and bool(getattr(value, "__dict__", None)))
    )  # (a tensor with attributes of its own: a function set on a parameter)


CONTAINERS = (list, tuple, dict, set, frozenset, collections.deque)
"""Containers (and their subclasses: an OrderedDict, a namedtuple) whose items the walk looks
into for code."""
MAX_ITEMS = 1024
"""Items of one container the walk looks at (at most :data:`MAX_VISITS` objects in all): the
code of a registry's later entries is not walked, as docs/guarded.md says."""


def _held_items(container: Any) -> list[Any]:
    """The items of ``container`` (a dict's values; a defaultdict's factory first) that may
    hold code, of the first :data:`MAX_ITEMS`."""
    items = container.values() if isinstance(container, dict) else container
    held = list(itertools.islice(iter(items), MAX_ITEMS))
    if isinstance(container, collections.defaultdict) and container.default_factory is not None:
        held.insert(0, container.default_factory)  # its factory (a lambda reading state)
    return [item for item in held if _may_hold_code(item) and not _plain(item)]


def _plain(item: Any) -> bool:
    """A list or tuple of plain values only (a row of a table of numbers): no code in it, and
    not worth one of the walk's visits (a 64x64 table of number pairs used them all up)."""
    return (
        type(item) in (list, tuple)
        and len(item) <= MAX_ITEMS
        and all(type(i) in PRIMITIVES for i in item)
    )


MAX_VISITS = 4000
"""Objects the walk for code looks at, at most (nested registries are walked too)."""


def callbacks_held(obj: Any) -> dict[str, Any]:
    """The attributes of a library's object that hold code of the user's: functions, bound
    methods and partials of them, instances of user classes, or a list, tuple or dict with
    one (an integrator's right-hand side, a scheduler's ``lr_lambdas``), or a container of
    those, or tensors with one set on them (an optimizer's ``param_groups[0]["gain"]``, a
    module's ``_parameters`` holding ``weight.sched``: probe 46b), by name; the first 64
    attributes (and 32 items per container) are looked at."""
    if isinstance(obj, _TIMES) and _users_code(obj.tzinfo):  # DT.utcoffset() runs it
        return {"tzinfo": obj.tzinfo}
    try:
        namespace = vars(obj)
    except TypeError:  # no __dict__ (slots, builtins)
        return {}
    return {n: v for n, v in list(namespace.items())[:64] if _holds_code(v, _NESTING)}


_TIMES = (datetime.datetime, datetime.time)
"""A library's values holding a ``tzinfo``, whose methods C calls (a user's class: code and
state of theirs, walked and guarded)."""


_NESTING = 2
"""How many containers (or tensors' attributes) deep :func:`callbacks_held` looks."""


def _holds_code(value: Any, depth: int) -> bool:
    if _users_code(value):
        return True
    if not depth:
        return False
    if type(value) in (list, tuple, collections.deque):  # LambdaLR's list, a Queue's deque
        items: Iterable[Any] = itertools.islice(value, 32)
    elif type(value) is dict:  # a dict of yours kept on a logger (LOG.hooks["scale"])
        items = itertools.islice(value.values(), 32)
    elif isinstance(value, torch.Tensor) and getattr(value, "__dict__", None):
        items = list(value.__dict__.values())[:32]  # lin.weight.sched = sched
    else:
        return False
    return any(_holds_code(item, depth - 1) for item in items)


def tensors_held(obj: Any, depth: int = 2) -> list[str]:
    """The attributes of a library's object that hold tensors (``Normal(loc, scale).loc``),
    or another library object holding some (``Independent(Normal(...), 1).base_dist``, two
    levels down), by name; the first 64 attributes are looked at."""
    try:
        namespace = vars(obj)
    except TypeError:  # no __dict__ (slots, builtins)
        return []
    return [n for n, v in list(namespace.items())[:64] if _holds_tensors(v, depth)]


def _holds_tensors(value: Any, depth: int) -> bool:
    if isinstance(value, torch.Tensor) or _small_array(value):  # a NumPy-backed Field's data
        return True  # (PhiML computes on it before any torch op sees it: probe 52)
    if not depth or isinstance(value, (type, types.ModuleType, torch.nn.Module, *PRIMITIVES)):
        return False
    if callable(value) or user_class(type(value)):
        return False  # code (walked as such), an object of yours (walked as such)
    return bool(tensors_held(value, depth - 1))


def _small_array(value: Any) -> bool:
    """A NumPy array of at most 4096 numbers (compared by content at every call)."""
    if isinstance(value, (type, *PRIMITIVES)) or probe(value, "__array_interface__") is None:
        return False
    dtype = probe(value, "dtype")
    return dtype is not None and not dtype.hasobject and probe(value, "size", 4097) <= 4096


def _users_code(value: Any) -> bool:
    """Whether ``value`` is a function of the user's, a bound method or partial of one, or an
    instance of a user class."""
    code = value.func if isinstance(value, functools.partial) else value
    code = code.__func__ if isinstance(code, types.MethodType) else code
    if isinstance(code, types.FunctionType):
        return user_function(code)
    return not isinstance(value, type) and user_class(type(value))
