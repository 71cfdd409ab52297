"""Stage 1 (reads): the global state of libraries that the user's code reads.

Libraries' modules are not walked: their functions and constants are taken as fixed, and the
code that reads them is traced through. Three kinds of what they hold change between calls,
set by the user's script, and a trace would bake them (NOTE [libraries' settings] in
docs/design.md):

* clocks and generators called through a module or class (``time.process_time()``,
  ``np.random.rand()``: :func:`._kinds.drawn_through`): a draw each call;
* switches kept as attributes, read by an attribute path the code spells
  (``torch.backends.mkldnn.enabled``, ``torch.backends.cuda.matmul.allow_tf32``, a solver
  library's ``DEFAULT_TOL``): their values are guarded (a constant such as ``math.pi`` or
  ``torch.float32`` is compared too, and never changes);
* readers of torch's global settings, functions of a torch module named ``get_...``,
  ``is_...`` or ``are_...`` (``torch.get_num_threads()``, ``torch.is_anomaly_enabled()``,
  ``torch.get_float32_matmul_precision()``) that answer without arguments with a plain value
  and no warning: the guard calls them and compares what they answer. Those that are fixed
  for a process or only true inside a compiler (``is_available``, ``is_compiling``) are not.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Collection, Iterable
from typing import Any

import torch

from ._code_walk import attribute_chains, method_chains, names_used, user_class, user_module
from ._kinds import drawn_through
from ._records import GONE, Source, Step, immutable

__all__ = ["library_sources", "library_reads", "answer_of", "READER_PREFIXES"]

READER_PREFIXES = ("get_", "is_", "are_")
"""How torch names the functions that read its global settings."""
_FIXED = ("available", "compiling", "tracing", "scripting", "built", "initialized")
"""Readers whose answer is fixed for a process, or true only inside a compiler or tracer."""
_FUNCTIONS = (types.BuiltinFunctionType, types.FunctionType)
_CALL = Step(True, "__call__", call=True)
"""Calls the value itself (a reader imported by name: ``from torch import get_num_threads``)."""


def library_sources(
    source: Source, code: types.CodeType, name: str, cell: bool = False
) -> list[tuple[tuple[Step, ...], Source]]:
    """What ``code`` reads of a library's global state through its global (or, ``cell``,
    closure variable) ``name`` at ``source`` (a module, class or function of a library's), as
    paths and their sources."""
    try:
        value = source.get()
    except GONE:  # an empty cell
        return []
    if isinstance(value, types.ModuleType) and user_module(value):
        return []
    if isinstance(value, type) and user_class(value):
        return []
    key = (cell, name)
    chains = {*attribute_chains(code).get(key, ()), *method_chains(code).get(key, ())}
    found = []
    for path in library_reads(value, names_used(code), chains):
        below = source
        for step in path:
            below = below.child(step)
        found.append((path, below))
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


def _state_at(root: Any, chain: tuple[Step, ...]) -> tuple[Step, ...] | None:
    """The path to guard along ``chain`` from a library's ``root``, or None: the whole
    chain where it ends in a plain value, or the call of a settings reader it ends in."""
    owner, value = root, root
    for step in chain:
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
    if chain and isinstance(owner, types.ModuleType) and _reader(value, chain[-1].key):
        return (*chain[:-1], Step(True, chain[-1].key, call=True))
    return None


def _reader(fn: Any, name: str) -> bool:
    """Whether ``fn``, found as ``name``, reads one of torch's global settings: a function of a
    torch module named like one, answering without arguments with a plain value and without
    a warning (``torch.is_autocast_enabled()`` without a device is deprecated)."""
    if not isinstance(fn, _FUNCTIONS):
        return False
    module = getattr(fn, "__module__", None) or ""
    if module != "torch" and not module.startswith("torch."):
        return False
    if not name.startswith(READER_PREFIXES) or any(word in name for word in _FIXED):
        return False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            answer = fn()
        except Exception:  # it needs arguments (torch.is_tensor): not a setting
            return False
    return not caught and immutable(answer)
