"""Stage 1 (reads): the plain attributes of the modules a call ran that the module guard
(``_guards``) does not compare, as reads: what a module, its parameters and buffers hold
beyond immutable values, and the slots of a module class of yours. See NOTE [module guards]
in docs/design.md.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

from torch import nn

from ._code_walk import names_in_user_code, user_class
from ._records import PYTHONS_OWN, Source, Step, immutable

__all__ = ["module_sources", "library_class_sources"]

_CODE = (types.FunctionType, types.BuiltinFunctionType, types.MethodWrapperType, type)
"""What a module attribute holds that is code, not data (a class: its data is walked where
code names it)."""

MACHINERY = frozenset(vars(nn.Module())) | {"training"}
"""What ``nn.Module.__init__`` sets (parameters, buffers, hooks): the module guard's."""


_STATE_DICT_MAKERS = ("_non_persistent_buffers_set", "_state_dict_hooks", "_state_dict_pre_hooks")
"""What decides a module's ``state_dict()`` beside its parameters and buffers: which buffers
are left out (``register_buffer(..., persistent=False)``), and the hooks that edit it."""


def module_sources(module: nn.Module, state_dict: bool = False) -> Iterator[tuple[Any, Source]]:
    """(key, source) of the plain attributes of ``module`` that the module guard does not
    cover: tensors that are not buffers (``self.mask = torch.ones(3)``) become inputs; lists,
    dicts and arrays are guarded by content, other objects by identity (immutable values:
    see ``_guards``). Also the mutable attributes of its parameters and buffers
    (``lin.weight.schedule = [1.0, 2.0]``, an iterator set on a bias) and the slots of its
    classes of yours (``__slots__ = ("n",)``), whatever they hold: probe round 35 found both
    unguarded. With ``state_dict`` (its ``state_dict()`` ran in the record pass): which
    buffers it leaves out and its state-dict hooks (probe 41b)."""
    namespace = module.__dict__
    where = f"{type(module).__qualname__} attributes"
    for name, value in list(namespace.items()):
        if name in MACHINERY or name in PYTHONS_OWN or immutable(value):
            continue
        if name.startswith("_") and name not in names_in_user_code(type(module)):
            continue  # private state only your code names: a library base's is its own
        if isinstance(value, nn.Module) and name not in namespace.get("_modules", {}):
            pass  # held apart from _modules (a parent, set with object.__setattr__): known,
            # by identity, so the module guard checks it as it checks submodules
        elif isinstance(value, nn.Module) or _is_code(value):
            continue  # submodules: the module guard; functions: not data (a bound method's
            # object is: ``self.fn = schedule.weight`` reads ``schedule``; so is a callable
            # object's: ``self.counter = Counter()``, its ``__call__`` changing ``self.k``)
        label = f"attribute {type(module).__name__}.{name}"
        yield (id(namespace), name), Source(label, where, namespace, name)
    yield from _tensor_attributes(module, where)
    yield from _slots(module, where)
    for name in _STATE_DICT_MAKERS if state_dict else ():
        if name in namespace:
            label = f"{type(module).__name__}.{name} (its state_dict())"
            yield (id(namespace), name), Source(label, where, namespace, name)


def _is_code(value: Any) -> bool:
    """Code, not data: a function, a class, a C function; not a C method bound to an object
    that is data (``self.lookup = cfg.get``, ``W.mul``, an iterator's ``__next__``,
    ``random.Random(0).random``), whose object is read (probe round 35 found each
    unguarded, an iterator's or generator's draws repeated)."""
    if not isinstance(value, (types.BuiltinMethodType, types.MethodWrapperType)):
        return isinstance(value, _CODE)
    owner = getattr(value, "__self__", None)
    return owner is None or isinstance(owner, (types.ModuleType, type))


def _tensor_attributes(module: nn.Module, where: str) -> Iterator[tuple[Any, Source]]:
    """The mutable Python attributes set on the module's own parameters and buffers."""
    owned = {**module.__dict__.get("_parameters", {}), **module.__dict__.get("_buffers", {})}
    for slot, tensor in owned.items():
        held = getattr(tensor, "__dict__", None) if tensor is not None else None
        for name, value in list((held or {}).items()):
            if name in PYTHONS_OWN or immutable(value):
                continue  # immutable ones: the module guard's
            if _is_code(value):
                continue
            label = f"attribute {type(module).__name__}.{slot}.{name}"
            yield (id(held), name), Source(label, where, held, name)


def _slots(module: nn.Module, where: str) -> Iterator[tuple[Any, Source]]:
    """The slots of the module's classes of yours, read as attributes of the module."""
    for klass in type(module).__mro__:
        if klass is nn.Module or not user_class(klass):
            continue
        slots = vars(klass).get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__") or not hasattr(module, name):
                continue  # not set yet: reading it raises, in eager code too
            label = f"slot {type(module).__name__}.{name}"
            path = (Step(True, name),)
            yield (id(module), "slot", name), Source(label, where, holder=module, path=path)


def library_class_sources(
    modules: Iterator[nn.Module], names: frozenset[str]
) -> Iterator[tuple[Any, Source]]:
    """Data kept on torch's (or another library's) module classes and read as ``self.NAME``
    or ``lin.NAME`` (``names``: what the walked code spells): ``nn.Linear.GAIN = 2.0``,
    ``nn.Module.EPS_SCALE``, a list or an object of yours set there (probe 44b). The module
    guard compares the class attributes of your classes only; a library's class holds its own
    constants too, guarded where the code spells them (they do not change)."""
    seen: set[tuple[int, str]] = set()
    for klass in {id(type(m)): type(m) for m in modules}.values():
        for base in klass.__mro__:
            if base is object or user_class(base):
                continue
            for name in names & vars(base).keys():
                value = vars(base)[name]
                if name in PYTHONS_OWN or _is_code(value) or (id(base), name) in seen:
                    continue
                if isinstance(value, (property, staticmethod, classmethod, types.ModuleType)):
                    continue  # descriptors and code: read through their own paths
                seen.add((id(base), name))
                label = f"class {base.__qualname__}.{name}"
                yield (
                    ("library class", id(base), name),
                    Source(label, base.__module__, holder=base, path=(Step(True, name),)),
                )
