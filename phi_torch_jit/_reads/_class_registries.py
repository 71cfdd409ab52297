"""Stage 1 (reads), the static walk's reach: code of the user's that a library keeps for the
user's classes in a registry keyed by class, and code that a ``ctypes`` object keeps for C to
call.

A library calls such code for the step without the step's code naming it:
``torch.utils._pytree.register_pytree_node(Pair, flatten, unflatten)`` puts ``flatten`` in a
module-level dict keyed by ``Pair`` (``tree_leaves(W)`` calls it);
``torch.distributions.kl.register_kl(MyNormal, MyNormal)`` puts a function in one keyed by a
pair of classes (``kl_divergence(p, q)`` calls it). Such registries are found by what they look
like: a module-level dict of a library's module whose first key is a class or a tuple of
classes (scanned once per module, again when modules are imported). Where the walk meets a
class of the user's, the entries registered for it are walked as the user's code (probe 42a).

A ``ctypes`` callback (``CFUNCTYPE(...)(fn)``, also as a structure's field) holds the Python
function C calls; the garbage collector sees it, the walk's other routes do not.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import sys
import threading
import types
from typing import Any

from ._code_walk import user_module

__all__ = ["registered_for", "ctypes_held"]

MAX_KEYS = 4096
"""Keys of one registry keyed by tuples of classes that are looked at for a class."""
_LOCK = threading.Lock()
_SCANNED: set[str] = set()
"""Names of the modules whose globals were scanned."""
_BY_CLASS: list[dict[Any, Any]] = []
"""Registries keyed by classes."""
_BY_CLASSES: list[dict[Any, Any]] = []
"""Registries keyed by tuples of classes."""
_EMPTY: list[dict[Any, Any]] = []
"""Module-level dicts that were empty when scanned (a registry filled later), sorted into
the two lists above once they hold something."""
_CDATA: type = ctypes.c_int.__mro__[-2]
"""``_ctypes._CData``, the base of every ``ctypes`` value."""


def _scan() -> None:
    """Note the registries of the library modules imported since the last scan."""
    if _SCANNED.issuperset(sys.modules):  # (a count would miss one imported as another left)
        return
    with _LOCK:
        for name, module in list(sys.modules.items()):
            if name in _SCANNED:
                continue
            _SCANNED.add(name)
            if not isinstance(module, types.ModuleType) or user_module(module):
                continue
            try:
                values = list(vars(module).values())
            except TypeError:  # a module object without a namespace
                continue
            for value in values:
                if type(value) is dict:
                    _sort(value)


def _sort(registry: dict[Any, Any]) -> None:
    """File a module-level dict by its first key (the caller holds ``_LOCK``)."""
    try:
        first = next(iter(registry))
    except (StopIteration, RuntimeError):  # empty (or changing): looked at again later
        _EMPTY.append(registry)
        return
    if isinstance(first, type):
        _BY_CLASS.append(registry)
    elif type(first) is tuple and first and all(isinstance(k, type) for k in first):
        _BY_CLASSES.append(registry)


def registered_for(cls: type) -> list[Any]:
    """What libraries' registries hold for ``cls`` (keyed by it, or by a tuple naming it)."""
    _scan()
    if any(_EMPTY):
        with _LOCK:
            filled = [registry for registry in _EMPTY if registry]
            _EMPTY[:] = [registry for registry in _EMPTY if not registry]
            for registry in filled:
                _sort(registry)
    found = []
    for registry in _BY_CLASS:
        try:
            if cls in registry:
                found.append(registry[cls])
        except Exception:  # a class whose metaclass hashes or compares oddly: not registered
            continue
    for registry in _BY_CLASSES:
        try:
            keys = list(itertools.islice(registry, MAX_KEYS))
        except RuntimeError:  # changed by another thread while listed: looked at next time
            continue
        found += [registry.get(k) for k in keys if type(k) is tuple and cls in k]
    return [value for value in found if value is not None]


def ctypes_held(value: Any) -> list[Any]:
    """The Python callables a ``ctypes`` value keeps for C to call: a callback's function, and
    those of the callbacks kept in a structure's or an array's fields (at most 64 objects are
    looked at). Empty for anything else."""
    if not isinstance(value, _CDATA):
        return []
    found: list[Any] = []
    pending: list[Any] = [value]
    for _ in range(64):
        if not pending:
            break
        item = pending.pop()
        if isinstance(item, dict):  # a ctypes value's ``_objects``: what it keeps alive
            pending += list(item.values())
            continue
        if item is not value and not type(item).__module__.endswith("ctypes"):
            continue
        for held in gc.get_referents(item):
            if isinstance(held, type):
                continue
            if isinstance(held, dict) or type(held).__module__.endswith("ctypes"):
                pending.append(held)
            elif callable(held):
                found.append(held)
    return found
