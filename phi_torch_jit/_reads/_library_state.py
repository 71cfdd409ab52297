"""Stage 1 (reads): the global state of libraries that the user's code reads.

Libraries' modules are not walked: their functions and constants are taken as fixed, and the
code that reads them is traced through. Five kinds of what they hold change between calls,
set by the user's script, and a trace would bake them (NOTE [libraries' settings] in
docs/design.md):

* clocks and generators called through a module or class (``time.process_time()``,
  ``np.random.rand()``: :func:`._kinds.drawn_through`): a draw each call;
* switches kept as attributes, read by an attribute path the code spells
  (``torch.backends.mkldnn.enabled``, ``torch.backends.cuda.matmul.allow_tf32``, a solver
  library's ``DEFAULT_TOL``): their values are guarded (a constant such as ``math.pi`` or
  ``torch.float32`` is compared too, and never changes);
* readers of torch's global settings, functions of a torch module named ``get_...``,
  ``is_...``, ``are_...`` or ``..._enabled`` (``torch.get_num_threads()``,
  ``torch.is_anomaly_enabled()``, ``torch.get_float32_matmul_precision()``) that answer
  without arguments with a plain value and no warning: the guard calls them and compares
  what they answer. Those fixed for a process or true only inside a compiler
  (``is_available``, ``is_compiling``) are not called;
* where the code spells ``autocast``, the dtypes ``torch.autocast("cpu")`` and ``("cuda")``
  cast to (``torch.set_autocast_dtype`` changes them);
* code and data of the user's kept on a library's module or class, read by a path the code
  spells: a function of yours (``F.my_act = my_act``: which one, by identity; its code is
  walked as yours, :mod:`._reachable`), an object of yours (``torch.SOLVER.k``), a container
  holding either (``torch.OPS["op"]``, ``json.CALLBACKS``) or plain values
  (``torch.my_cfg["k"]``: by content). A library's own registries are not (:func:`_yours`).

Reached through a library's module held by the user's objects too: along a path the code
spells (``K.backend.enabled``: :func:`library_held`, from ``_python._add_chains``), or read
through a local name (``for b in BACKENDS: b.enabled``, ``self.backend.enabled``, a default:
:func:`settings_of_held`, every name the walked code spells looked up on the module).
"""

from __future__ import annotations

import collections
import collections.abc
import itertools
import types
import warnings
from collections.abc import Collection, Iterable
from typing import Any

import torch

from ._code_walk import chains_spelled, names_used, user_class, user_module
from ._content import plain_container
from ._kinds import drawn_through
from ._reachable import CONTAINERS, holds_users_code
from ._records import GONE, Source, Step, immutable, probe

__all__ = ["library_sources", "library_reads", "library_held", "answer_of", "settings_of_held",
           "READER_PREFIXES"]  # fmt: skip

READER_PREFIXES = ("get_", "is_", "are_")
"""How torch names the functions that read its global settings."""
_FIXED = ("available", "compiling", "tracing", "scripting", "built", "initialized")
"""Readers whose answer is fixed for a process, or true only inside a compiler or tracer."""
_AUTOCAST = frozenset(("autocast", "get_autocast_dtype"))
"""Names through which code enters autocast or reads its dtype."""
_AUTOCAST_DTYPES = tuple(
    Step(True, "get_autocast_dtype", call=True, argument=device) for device in ("cpu", "cuda")
)
"""The dtypes ``torch.autocast(device)`` casts to unless told (``torch.set_autocast_dtype``)."""
_FUNCTIONS = (types.BuiltinFunctionType, types.FunctionType)
_CALL = Step(True, "__call__", call=True)
"""Calls the value itself (a reader imported by name: ``from torch import get_num_threads``)."""


def library_held(value: Any) -> bool:
    """Whether ``value`` is a library's module or class (a user's is walked as state)."""
    if isinstance(value, types.ModuleType):
        return not user_module(value)
    return isinstance(value, type) and not user_class(value)


def library_sources(
    source: Source,
    code: types.CodeType | None,
    name: str,
    chains: Iterable[tuple[Step, ...]] = (),
    cell: bool = False,
) -> list[tuple[tuple[Step, ...], Source]]:
    """What ``code`` reads of a library's global state through its global (or, ``cell``,
    closure variable) ``name`` at ``source`` (a module, class or function of a library's), as
    paths and their sources. ``code`` None: along ``chains`` only, from a library's module
    held by an object of the user's (``K.backend.enabled``)."""
    try:
        value = source.get()
    except GONE:  # an empty cell
        return []
    if isinstance(value, (types.ModuleType, type)) and not library_held(value):
        return []
    names: Collection[str] = ()
    if code is not None:
        chains = chains_spelled(code).get((cell, name), ())
        names = names_used(code)
    found = []
    for path in library_reads(value, names, chains):
        below = source
        for step in path:
            below = below.child(step)
        found.append((path, below))
    if _AUTOCAST & set(names):  # torch.autocast("cpu") entered in the step takes the
        for step in _AUTOCAST_DTYPES:  # process's autocast dtype (set_autocast_dtype)
            label = f"torch.get_autocast_dtype({step.argument!r})"
            found.append(((step,), Source(label, source.location, holder=torch).child(step)))
    return found


def library_reads(
    value: Any, names: Collection[str], chains: Iterable[tuple[Step, ...]]
) -> list[tuple[Step, ...]]:
    """Paths under ``value`` (a library's module, class or function the code reads as a
    global) to guard: draws (``names``: those the code spells), switches and settings'
    readers (``chains``: the attribute paths and method calls the code spells from it)."""
    if isinstance(value, _FUNCTIONS):
        return [(_CALL,)] if _reader(value, value.__name__) else []
    if not isinstance(value, (types.ModuleType, type)):
        return []
    found = [tuple(Step(True, n) for n in path) for path in drawn_through(value, names)]
    for chain in chains:
        path = _state_at(value, chain)
        if path is not None and path not in found:
            found.append(path)
    return found


def answer_of(value: Any, source: Source) -> Source | None:
    """Where a settings reader the walk met as a value (in a dict, a class attribute, a
    default, a partial: ``READERS["n"]()``) answers, to guard by value; None for others."""
    if isinstance(value, staticmethod):  # a class attribute of yours: staticmethod(reader)
        inner = value.__func__
        if isinstance(inner, _FUNCTIONS) and _reader(inner, inner.__name__):
            return source.child(Step(True, "__func__", call=True))
    if isinstance(value, _FUNCTIONS) and _reader(value, value.__name__):
        return source.child(_CALL)
    return None


_MAX_ITEMS = 64
"""Items of a container or attributes of an object looked at for a library's module."""


def settings_of_held(
    values: Iterable[Any], functions: Iterable[types.FunctionType]
) -> list[tuple[Any, Source]]:
    """Settings of a library's modules that the user's state holds where the code reads them
    from a local name (``for mod in BACKENDS: mod.enabled``, ``self.backend.enabled`` of an
    ``nn.Module``, ``def f(x, mod=torch.backends.mkldnn)``): each module found in ``values``
    (the read objects, their items and attributes) or in the functions' defaults, and each
    name the functions' code spells that the module answers with a plain value or as a
    settings reader, as (key, source) pairs. The holder's own guard sees another module."""
    names: set[str] = set()
    roots: list[Any] = list(values)
    for function in functions:
        names |= names_used(function.__code__)
        roots += [*(function.__defaults__ or ()), *(function.__kwdefaults__ or {}).values()]
    candidates: list[Any] = []
    for value in roots:  # each, its items or attributes, and theirs (a namedtuple on a module)
        candidates.append(value)
        for held in _held_by(value):
            candidates += [held, *_held_by(held)]
    modules = {id(m): m for m in candidates if isinstance(m, types.ModuleType) and library_held(m)}
    found: list[tuple[Any, Source]] = []
    for module in modules.values():
        root = Source(f"module {module.__name__}", module.__name__, holder=module)
        for name in sorted(names):
            path = None if name.startswith("__") else _state_at(module, (Step(True, name),))
            if path is not None:
                found.append((("held library module", id(module), name), root.child(path[0])))
    return found


def _held_by(value: Any) -> list[Any]:
    """The items of a plain container or the attributes of an object (not a module's or a
    class's: those are walked by name), a few dozen at most."""
    if isinstance(value, (types.ModuleType, type, str, bytes, torch.Tensor)):
        return []
    if isinstance(value, (tuple, list, set, frozenset, collections.deque)):
        return list(itertools.islice(value, _MAX_ITEMS))  # a namedtuple, a list subclass
    if isinstance(value, dict):
        return list(itertools.islice(value.values(), _MAX_ITEMS))
    attributes = probe(value, "__dict__")
    return list(attributes.values())[:_MAX_ITEMS] if type(attributes) is dict else []


def _state_at(root: Any, chain: tuple[Step, ...]) -> tuple[Step, ...] | None:
    """The path to guard along ``chain`` from a library's ``root``, or None: the whole
    chain where it ends in a plain value or a function of the user's, the call of a settings
    reader it ends in, or the chain up to the first state of the user's it meets (a container
    or an object: what is under it is walked from there)."""
    owner, value = root, root
    for n, step in enumerate(chain):
        if n and _yours(value) and not isinstance(value, types.FunctionType):
            return chain[:n]  # torch.OPS["op"], torch.SOLVER.k: your state kept there
        if not step.attribute or step.key.startswith("__"):
            return None
        try:
            owner, value = value, getattr(value, step.key)
        except Exception:  # a library's attribute that raises: nothing the code could read
            return None
    if isinstance(value, torch.dtype) and owner is torch:
        return None  # torch.float32: torch's own names of its types, never rebound
    if immutable(value) and not isinstance(value, (type, types.ModuleType)):
        return chain
    if _yours(value):  # F.my_act = my_act (by identity, its code walked), torch.my_cfg = {...}
        return chain
    if chain and isinstance(owner, types.ModuleType) and _reader(value, chain[-1].key):
        return (*chain[:-1], Step(True, chain[-1].key, call=True))
    return None


def _yours(value: Any) -> bool:
    """Whether ``value``, kept on a library's module or class, is state the user's code reads
    as its own: a function or object of the user's, a container holding one, or a container
    of plain values (``sys.argv``). A library's own registry (``warnings.filters``, rebound to
    a copy by every ``catch_warnings``; ``copyreg.dispatch_table``) is not: guarded, it made a
    loop's every call retrace."""
    if isinstance(value, (type, types.ModuleType)):
        return False
    if isinstance(value, collections.abc.Iterator):  # json.STREAM = cycle(...): its draws
        return True  # (a step calling next() on it runs eagerly: probe 44b)
    if isinstance(value, CONTAINERS):
        return holds_users_code(value) or plain_container(value) or _holds_iterator(value)
    return holds_users_code(value)


def _holds_iterator(container: Any) -> bool:
    """A container kept on a library's module holding an iterator (``torch.CFG["it"]``)."""
    items = container.values() if isinstance(container, dict) else container
    return any(isinstance(v, collections.abc.Iterator) for v in itertools.islice(items, _MAX_ITEMS))


def _reader(fn: Any, name: str) -> bool:
    """Whether ``fn``, found as ``name``, reads one of torch's global settings: a function of a
    torch module named like one, answering without arguments with a plain value and without
    a warning (``torch.is_autocast_enabled()`` without a device is deprecated)."""
    if not isinstance(fn, _FUNCTIONS):
        return False
    module = getattr(fn, "__module__", None) or ""
    if module != "torch" and not module.startswith("torch."):
        return False
    if not name.startswith(READER_PREFIXES) and not name.endswith("_enabled"):
        return False  # torch.backends.cuda.math_sdp_enabled()
    if any(word in name for word in _FIXED):
        return False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            answer = fn()
        except Exception:  # it needs arguments (torch.is_tensor): not a setting
            return False
    return not caught and immutable(answer)
