"""Stage 1 (reads), the shape of the walk: what lies one step under an object read by the
step, and how deep the walk goes (NOTE [attribute paths]). :func:`fields` lists the steps
under a configuration object: public attributes of namespaces and of instances of user
classes, class data, the methods of user classes (from their class's ``__dict__``: the same
object on every read), entries of dicts (and of dict subclasses of yours) and items of lists,
a bound method's object, what a ``functools.partial`` binds and calls: steps that cost no
level of :data:`TREE_DEPTH`."""

from __future__ import annotations

import argparse
import collections
import configparser
import contextvars
import enum
import functools
import operator
import sys
import threading
import types
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .._libraries import configuration_classes
from .._signature import NAMESPACES
from ._callable_attributes import WRAPPERS, attribute_paths
from ._class_fields import class_data, dataclass_fields, shadowed_bases, type_alias
from ._code_walk import user_class, user_function
from ._reachable import callbacks_held, tensors_held, wrapper_cells
from ._reading_code import reads_only
from ._records import LENGTH, LISTED, PYTHONS_OWN, UNSET, Step, enum_attributes, immutable, probe
from ._shown import VIEWS, called_with, shown

__all__ = ["fields", "has_attributes", "has_attribute", "depth", "TREE_DEPTH", "INSTANCE_DICT",
           "shows_content", "masked", "runs_code", "computed",
           "tensor_attributes"]  # fmt: skip


def _class_of(value: Any) -> type:
    """The class whose attributes ``value`` has (a weak proxy's: its object's)."""
    return value.__class__ if isinstance(value, weakref.ProxyTypes) else type(value)


def _bag(klass: type) -> bool:
    """Its instances hold configuration: namespaces, thread-locals, a library's settings."""
    local = issubclass(klass, threading.local)  # and a library's settings (PhiML's Solve):
    return klass in NAMESPACES or local or klass in configuration_classes()


def has_attributes(value: Any) -> bool:
    """Whether ``value`` is a namespace or an instance of a user class with a ``__dict__``."""
    klass = _class_of(value)
    plain = _bag(klass) or (user_class(klass) and not isinstance(value, type))
    return plain and not isinstance(value, nn.Module) and has_attribute(value, "__dict__")


def tensor_attributes(tensor: torch.Tensor) -> list[Step | tuple[Step, ...]]:
    """Paths to the Python attributes set on a tensor the step reads (``W.scale = 2.0``, a
    parameter's ``lr_scale``) and to how many there are: none where it has none (a tensor
    is an input of the program, its attributes are not)."""
    own = probe(tensor, "__dict__")
    if type(own) is not dict or not own:
        return []
    names = [n for n in own if isinstance(n, str) and n.isidentifier() and not _dunder(n)]
    return [(INSTANCE_DICT, LENGTH), *(Step(True, n) for n in names)]


def fields(value: Any) -> list[Step | tuple[Step, ...]]:
    """The attribute paths one step under a configuration object (NOTE [attribute paths]):
    attributes of namespaces and of instances of user classes, private ones included
    (dataclasses too; class attributes too), data attributes of user classes, str/int
    entries of dicts, items of lists and tuples (``models[0]``), members of sets in their
    order and of NumPy object arrays, how many a weak registry holds, the object of a bound
    method, the arguments a ``functools.partial`` binds.
    Libraries' objects stay guarded by identity: their internals are not the user's state."""
    yours = user_class(type(value))  # a dict subclass of yours: its entries and attributes
    if type(value) in _MAPPINGS or (yours and isinstance(value, dict)):
        keys = list(value)  # entries by name or number; objects used as keys, by position
        objects = [(_KEYS, LISTED, Step(False, i)) for i, k in enumerate(keys) if _object_key(k)]
        order = [(_KEYS, LISTED)] if _ordered(keys) and not objects else []  # keys in order:
        named = [Step(False, k) for k in keys if type(k) in (str, int)]  # (a loop over the
        placed = [(_VALUES, LISTED, Step(False, i))  # values sees TERMS["a"] = TERMS.pop("a"))
                  for i, k in enumerate(keys) if type(k) not in (str, int)]  # fmt: skip
        steps: list[Step | tuple[Step, ...]] = [*order, *named, *placed, *objects]  # (under
        if isinstance(value, collections.defaultdict):  # an enum...: by position); what makes
            steps.append(Step(True, "default_factory"))  # missing entries (probe 53a)
        return [*steps, *_object_fields(value)] if yours else steps
    if type(value) in (list, tuple, collections.deque):  # not a library's subclass
        return [Step(False, i) for i in range(len(value))]
    if type(value) in (set, frozenset):  # objects in a set: each member in the set's order
        return [(LISTED, Step(False, i)) for i in range(len(value))]
    if isinstance(value, configparser.RawConfigParser):  # its values, by section: content
        return [Step(True, "_sections"), Step(True, "_defaults")]
    if isinstance(value, configparser.SectionProxy):  # CP["solver"] held: its parser
        return [Step(True, "parser")]
    if isinstance(value, weakref.WeakKeyDictionary):  # how many; the values it holds
        return [LENGTH, *_listed_values(len(value))]
    if isinstance(value, _WEAK):  # how many are registered (members are not held), and
        members = list(value) if isinstance(value, weakref.WeakSet) else []  # iterators (39b)
        iterators = [i for i, m in enumerate(members) if isinstance(m, collections.abc.Iterator)]
        return [LENGTH, *((LISTED, Step(False, i)) for i in iterators)]  # (eager)
    if (under := shown(value)) is not None:  # a view, a slice, a UserDict... (_shown)
        return under
    if getattr(probe(value, "dtype"), "hasobject", False) and has_attribute(value, "flat"):
        return [(Step(True, "flat"), Step(False, i)) for i in range(value.size)]  # objects
    if isinstance(value, types.MethodType):  # the object it is bound to: its state is read,
        hides = not isinstance(value.__func__, types.FunctionType)  # and a partial or callable
        return [Step(True, "__self__"), *([Step(True, "__func__")] if hides else [])]  # bound
    if isinstance(value, _BUILTIN_BOUND) and _holds_state(getattr(value, "__self__", None)):
        return [Step(True, "__self__")]  # TABLE.get, ARR.sum held: the dict or array it reads
    if isinstance(value, contextvars.Context):  # CTX[var] after CTX.run(var.set, 4.0)
        return [LENGTH, *_listed_values(len(value))]
    if masked(value):  # a NumPy masked array: what is masked, besides the data, and with what
        return [Step(True, "data"), Step(True, "mask"), Step(True, "fill_value")]
    if isinstance(value, (functools.partial, functools.partialmethod)):  # what it binds
        bound: list[Step | tuple[Step, ...]] = [Step(True, "args"), Step(True, "keywords")]
        bound.append(Step(True, "func"))  # and what it calls, and what is set on it (P.k)
        return [*bound, *(_object_fields if user_class(type(value)) else attribute_paths)(value)]
    if isinstance(value, types.ModuleType):  # a user's module (libraries' are not read): its
        entries = [Step(True, n) for n, v in list(vars(value).items()) if _module_data(n, v)]
        return [(INSTANCE_DICT, LENGTH), (INSTANCE_DICT, _KEYS, LISTED), *entries]  # data,
        # how many names and their order (vars() looped; probe 54: a name defined again)
    if isinstance(value, types.FunctionType):  # code, walked by user_functions; a single-
        registry = value.__dict__.get("registry")  # dispatch function: what is registered,
        if not isinstance(registry, Mapping):  # how many and each implementation (replaced
            return _wrapper_held(value)  # by a later register() of the same type)
        held = [(Step(True, "registry"), *path) for path in _listed_values(len(registry))]
        return [(Step(True, "registry"), LENGTH), *held]
    if isinstance(value, nn.Module):
        return []  # the module guard
    if isinstance(value, enum.Enum):  # a member whose value holds a list, or with attributes
        return [Step(True, "value"), *(Step(True, n) for n in enum_attributes(value))]
    if isinstance(value, contextvars.ContextVar):  # what it holds in the caller's context,
        now: list[Step | tuple[Step, ...]] = [Step(True, "get", call=True, argument=UNSET)]
        default = [Step(True, "get", call=True)] if _has_default(value) else []  # or holds
        return [*now, *default]  # nothing; and its default (var.get() where never set)
    if isinstance(value, weakref.WeakMethod):  # a new bound method on each call: its parts
        return [(_DEREFERENCED, Step(True, "__self__")), (_DEREFERENCED, Step(True, "__func__"))]
    if isinstance(value, weakref.ref):  # the object it refers to (None once that is gone)
        return [_DEREFERENCED]
    if isinstance(value, weakref.finalize):  # FIN.peek(): its object, function, arguments
        return [(_PEEKED, Step(False, i)) for i in range(4)]  # (a new tuple each time)
    if isinstance(value, type):  # its data, then its methods (replaced on the class), and
        klasses = [k for k in value.__mro__ if k is not object and user_class(k)]  # a
        meta = [Step(True, "__class__")] if user_class(type(value)) else []  # metaclass of yours
        ordered = user_class(value)  # vars(K) in its order
        listed: list[tuple[Step, ...]] = [(INSTANCE_DICT, _KEYS, LISTED)] if ordered else []
        if issubclass(value, tuple) and hasattr(value, "_fields"):  # a namedtuple's defaults,
            listed.append((Step(True, "__new__"), Step(True, "__defaults__")))  # set there too
        data = (Step(True, n) for n in class_data(klasses))
        named = [Step(True, n) for n in ("__name__", "__qualname__", "__mro__")] if ordered else []
        hidden = shadowed_bases(value)  # super().K, where a subclass defines K too
        fields = dataclass_fields(value) if ordered else []
        return [*listed, *named, *data, *_methods(value), *meta, *hidden, *fields]
    if type_alias(value):  # list[A], Optional[A]: what typing.get_args returns
        return [Step(True, "__args__")]
    if isinstance(value, functools.singledispatchmethod):  # what is registered on it
        return [Step(True, "dispatcher")]
    if isinstance(value, (operator.methodcaller, operator.itemgetter)):  # what it calls with
        return called_with(value)  # or the items it gets: shown by __reduce__ only
    if isinstance(value, property):  # its accessors: a partial's bound values are state
        return [Step(True, n) for n in ("fget", "fset", "fdel") if getattr(value, n) is not None]
    if isinstance(value, (staticmethod, classmethod)):  # what it wraps (a partial too)
        return [Step(True, "__func__"), *attribute_paths(value)]
    if isinstance(value, functools.cached_property):
        return [Step(True, "func"), *attribute_paths(value)]
    if isinstance(value, torch.optim.Optimizer):  # its settings (a scheduler changes lr),
        return _settings(value)  # read however the step reaches them (for g in param_groups)
    if isinstance(value, argparse.ArgumentParser):  # what parse_args() reads of it
        return _parsed_from(value)
    if isinstance(value, WRAPPERS):  # an lru_cache wrapper: its function, what is set on it
        return [Step(True, "__wrapped__"), *attribute_paths(value)]
    return _object_fields(value)


def _object_fields(value: Any) -> list[Step | tuple[Step, ...]]:
    """An object's attributes (a subclass of yours of a partial too: its own and its
    class's, probe 36a)."""
    klass = _class_of(value)
    plain = _bag(klass) or user_class(klass)  # a library's objects: by identity, and the
    if not plain:  # code of yours they hold (``integrator.rhs = my_rhs``), and tensors
        return [Step(True, n) for n in (*callbacks_held(value), *tensors_held(value))]
    in_order: list[Step | tuple[Step, ...]] = []
    if has_attribute(value, "__dict__"):
        names = [n for n in vars(value) if n.isidentifier() and n not in PYTHONS_OWN]
        if len(names) > 1:  # a loop over vars(cfg) sees them in this order
            in_order = [(INSTANCE_DICT, _KEYS, LISTED)]
    else:  # a class with __slots__ (a dataclass with slots=True): its set slots
        names = [n for n in _slots(klass) if has_attribute(value, n)]
    names += [n for n in class_data([k for k in klass.__mro__ if user_class(k)])
              if n not in names]  # fmt: skip
    steps: list[Step | tuple[Step, ...]] = [*in_order, *(Step(True, n) for n in names)]
    if isinstance(value, dict):  # a dict or list subclass of yours: its entries too
        steps += [Step(False, k) for k in value if type(k) in (str, int)]
    elif isinstance(value, (list, tuple)):  # a namedtuple's items: its fields, by position
        steps += [Step(False, i) for i in range(len(value))]  # (read through descriptors)
    return [*steps, Step(True, "__class__")] if user_class(klass) else steps


_BUILTIN_BOUND = (types.BuiltinMethodType, types.MethodWrapperType)


def _settings(optimizer: torch.optim.Optimizer) -> list[Step | tuple[Step, ...]]:
    """Paths to each parameter group's settings (``lr``, ``momentum``, ``betas``; not its
    parameters, which the step reads as tensors), how many groups there are, and its
    ``state`` (a momentum buffer the step reads: an input, an entry added by a step seen)."""
    groups = Step(True, "param_groups")
    paths: list[Step | tuple[Step, ...]] = [(groups, LENGTH), Step(True, "state")]
    for i, group in enumerate(optimizer.param_groups):
        paths += [(groups, Step(False, i), Step(False, k)) for k in group if k != "params"]
    return paths


def _parsed_from(parser: argparse.ArgumentParser) -> list[Step | tuple[Step, ...]]:
    """Paths to what ``parse_args()`` reads of a parser: its ``set_defaults``, how many
    arguments it has and each one's settings (``ACT = P.add_argument(...)``, then
    ``ACT.default = 3.0``: the parser itself is a library's object, guarded by identity, and
    the new default was not seen: probe 48)."""
    actions = Step(True, "_actions")
    paths: list[Step | tuple[Step, ...]] = [Step(True, "_defaults"), (actions, LENGTH)]
    for i in range(min(len(parser._actions), 64)):
        paths += [(actions, Step(False, i), Step(True, n)) for n in _PARSED]
    return paths


_PARSED = ("dest", "option_strings", "default", "const", "type", "nargs", "choices", "required")


_VALUES = Step(True, "values", call=True)
_DEREFERENCED, _PEEKED = Step(True, "__call__", call=True), Step(True, "peek", call=True)


def _wrapper_held(function: types.FunctionType) -> list[Step | tuple[Step, ...]]:
    """Paths to what a library's wrapper of a function holds in its closure (the context
    manager of ``@Scaled(k)``: ``Scaled.k`` is read around every call)."""
    if "__wrapped__" not in function.__dict__ or user_function(function):
        return []
    held = wrapper_cells(function)
    return [(_CLOSURE, Step(False, i), _CONTENTS)
            for i, name in enumerate(function.__code__.co_freevars) if name in held]  # fmt: skip


_CLOSURE, _CONTENTS = Step(True, "__closure__"), Step(True, "cell_contents")


def _holds_state(owner: Any) -> bool:
    """Whether a builtin method's object is state of the user's (not a module, a class or
    None: ``math.sqrt``, ``dict.fromkeys``)."""
    return owner is not None and not isinstance(owner, (types.ModuleType, type))


def masked(value: Any) -> bool:
    """A NumPy masked array (its mask is state besides its data)."""
    ma = sys.modules.get("numpy.ma")
    return ma is not None and isinstance(value, ma.MaskedArray)


_WEAK = (weakref.WeakSet, weakref.WeakValueDictionary, weakref.WeakKeyDictionary)
_MAPPINGS = (dict, collections.OrderedDict, collections.defaultdict, collections.Counter,
             types.MappingProxyType)  # fmt: skip
_KEYS = Step(True, "keys", call=True)


def _object_key(key: Any) -> bool:
    """A dict key that is an object with state of its own (``for st in D: st.k``)."""
    if isinstance(key, (tuple, frozenset)):  # (1, cfg) or a namedtuple holding objects
        return not all(immutable(item) for item in key)
    if isinstance(key, type):  # {A: 1.0}: a class of yours, its data (probe 51)
        return user_class(key)
    return not isinstance(key, (str, int, float, bytes, enum.Enum))


def _listed_values(n: int) -> list[tuple[Step, ...]]:
    """Paths to a mapping's values by position (``tuple(m.values())[i]``: keys that are not
    names or numbers, such as types or objects)."""
    return [(Step(True, "values", call=True), LISTED, Step(False, i)) for i in range(n)]


def shows_content(value: Any) -> bool:
    """A dict's view held apart from it, or an instance of a container subclass of yours
    (``class Table(dict)``): what it holds is read through methods (``get``, ``in``, ``sum``)
    that no attribute path spells."""
    if isinstance(value, VIEWS):
        return True
    containers = (dict, list, set, frozenset, collections.deque)
    return isinstance(value, containers) and user_class(type(value))


_STRUCTURE = frozenset(("__self__", "func", "args", "keywords", "__class__", "__mro__",
                        "__dict__"))  # fmt: skip
"""Steps through a callable's or an object's machinery (a partial's function and bound
arguments, a method's object, an instance's class): they cost no level of the walk."""

TREE_DEPTH = 7
"""Levels of data (attributes, entries) walked under a global, a closure variable or a held
object; the whole tree shares ``_MAX_FIELDS`` reads."""


def depth(path: tuple[Step, ...]) -> int:
    return sum(1 for step in path if not (step.attribute and step.key in _STRUCTURE))


def has_attribute(value: Any, name: str) -> bool:
    """``hasattr`` as :func:`probe` reads: no ``__getattr__`` of the object's class is run."""
    return probe(value, name, _MISSING) is not _MISSING


def _methods(klass: type) -> list[tuple[Step, ...]]:
    """Paths to the methods (functions, static and class methods, properties, partialmethods,
    ``__call__``) defined on the user classes of ``klass``'s MRO, each read from its class's
    ``__dict__`` (``K.__mro__[1].__dict__['__call__']``: the descriptor itself, the same
    object on every read), guarded by identity: a method replaced on a class, a base class
    reached through ``super()`` included, retraces."""
    paths: list[tuple[Step, ...]] = []
    for i, base in enumerate(klass.__mro__):
        if base is object or not user_class(base):
            continue
        for name, member in vars(base).items():
            if name not in _CLASS_MACHINERY and (
                callable(member) or hasattr(type(member), "__get__")
            ):
                paths.append(
                    (Step(True, "__mro__"), Step(False, i), INSTANCE_DICT, Step(False, name))
                )
    return paths


INSTANCE_DICT = Step(True, "__dict__")
_CLASS_MACHINERY = frozenset(("__dict__", "__weakref__", "__module__", "__doc__", "__qualname__",
                              "__annotations__", "__slots__", "__init_subclass__"))  # fmt: skip


def _slots(klass: type) -> list[str]:
    """The attribute names the ``__slots__`` of the user classes in ``klass``'s MRO declare
    (private ones as Python mangles them: ``__n`` of ``K`` is ``_K__n``)."""
    names: list[str] = []
    for base in klass.__mro__:
        if not user_class(base):
            continue
        declared = vars(base).get("__slots__", ())
        for name in (declared,) if isinstance(declared, str) else declared:
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{base.__name__.lstrip('_')}{name}"
            if not _dunder(name) and name not in names:
                names.append(name)
    return names


def _module_data(name: str, value: Any) -> bool:
    """Whether a module attribute is configuration the walk descends into: data and the
    user's classes (``settings.Inner.RATE``), not functions (code: walked where called),
    other modules, or classes imported from libraries."""
    if _dunder(name) or not name.isidentifier():
        return False
    if isinstance(value, type):
        return user_class(value)
    return not isinstance(value, _CODE_OR_MODULES)


_CODE_OR_MODULES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                    types.ModuleType, functools.partial)  # fmt: skip


def _dunder(name: str) -> bool:
    """Python's own names (``__dict__``, ``__module__``); private ones (``_dt``, a setter's
    target) are the user's state like public ones."""
    return name.startswith("__") and name.endswith("__")


_PLAIN_MEMBERS = (types.FunctionType, staticmethod, classmethod, functools.cached_property,
                  types.MemberDescriptorType, types.GetSetDescriptorType)  # fmt: skip
"""Class members a path may read: a method (bound, not run), a cached property (run once, as
the step would, then a plain attribute), a slot, ``__dict__``."""


def runs_code(owner: Any, step: Step) -> bool:
    """Whether reading ``step`` of ``owner`` runs code of the user's that does more than read
    (a property, another descriptor, ``__getattr__``, ``__getattribute__`` or ``__getitem__``
    of a user class that writes state or calls the user's code: ``_reading_code.reads_only``):
    the guard must not run it (a property advancing a schedule ran 7 more times a call). What
    that code reads is guarded where the walk reaches it (the object's attributes, its
    globals). Code that only reads (``return self.opt.param_groups[0]["lr"]``) is run by the
    guard, which compares its value."""
    klass = type(owner)
    if not user_class(klass) or isinstance(owner, type) or step.length or step.listed:
        return False
    user_bases = [k for k in klass.__mro__ if user_class(k)]

    def defined(name: str) -> Any:
        return next((vars(k)[name] for k in user_bases if name in vars(k)), None)

    if not step.attribute:
        getitem = defined("__getitem__")
        return getitem is not None and not reads_only(getitem)
    answers = defined("__getattribute__")
    if answers is not None:
        return not reads_only(answers)
    for base in klass.__mro__:
        member = vars(base).get(step.key, _MISSING)
        if member is _MISSING:
            continue
        if isinstance(member, _PLAIN_MEMBERS) or not hasattr(type(member), "__get__"):
            return False
        own = getattr(owner, "__dict__", {})
        if not hasattr(type(member), "__set__") and step.key in own:
            return False  # the instance's own value shadows it
        getter = member.fget if isinstance(member, property) else type(member).__get__
        return not reads_only(getter)
    own = getattr(owner, "__dict__", None)
    if isinstance(own, dict) and step.key in own:
        return False
    getattr_ = defined("__getattr__")
    return getattr_ is not None and not reads_only(getattr_)


def computed(owner: Any, step: Step) -> bool:
    """Whether ``step`` of ``owner`` is a property (``normal.mean``): a tensor it returns is
    made from the object's own tensors on each read, not one to put a traced input in place
    of (it has no setter)."""
    if not step.attribute or isinstance(owner, type):
        return False
    member = next((vars(k)[step.key] for k in type(owner).__mro__ if step.key in vars(k)), None)
    return isinstance(member, property)


_MISSING = object()


def _has_default(var: contextvars.ContextVar[Any]) -> bool:
    """Whether ``var`` was made with a default: what ``var.get()`` returns where it was never
    set, whose content (a dict, an object's fields) a step may read (probe 43a)."""
    try:
        contextvars.Context().run(var.get)
    except LookupError:
        return False
    return True


def _ordered(keys: list[Any]) -> bool:
    """Whether a dict's keys are compared as a tuple (in canonical form: types and signs): two
    or more (their order), or one that is not a string (``{2: f}`` re-keyed ``{2.0: f}``,
    ``{True: f}`` or ``{0.0: f}`` to ``{-0.0: f}`` finds the same entry under the old key)."""
    return len(keys) > 1 or (len(keys) == 1 and type(keys[0]) is not str)
