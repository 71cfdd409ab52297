"""Stage 1 (record): which abstract base classes ``isinstance``/``issubclass`` test, and what.

``ABC.register(C)`` changes what ``isinstance(c, ABC)`` answers, in C state no attribute shows,
and a compiled program keeps the first answer (probe 41a). Guarding ``abc.get_cache_token()``,
which every registration anywhere changes, wherever code of yours spelled ``isinstance``
retraced such a step at registrations that could not change its answers: the libraries torch
imports while it compiles (sympy registers its numbers with ``numbers``) retraced a step
testing ``isinstance(x, torch.Tensor)`` twice after its first call on the default engine.

While the record pass runs, ``ABCMeta.__instancecheck__`` notes each (ABC, class tested) pair
where code of yours tests, or a class of yours is tested or tests (an ABC of yours), by any
code; ``_reads/_type_tests`` guards their answers. Other threads and phases pass straight
through (the notes are this thread's record pass's). ``issubclass`` is not watched (typing's
protocols look at the module of the frame that calls their hook, and a wrapper's frame made
them raise): where code of yours names it, the token is guarded, as before.
"""

from __future__ import annotations

import abc
import functools
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

from ._patches import RefCounted
from ._sources import TORCH_DIR, user_module
from ._watched_calls import from_user, recording_notes

__all__ = ["TYPE_TESTS", "MAX_TYPE_TESTS", "ANY_REGISTRATION"]

MAX_TYPE_TESTS = 256
"""Pairs noted per record pass; past it, ``abc.get_cache_token()`` is guarded as well."""

ANY_REGISTRATION = (abc.ABCMeta, abc.ABCMeta)
"""Noted where a test's answer is not the ABC machinery's alone (a metaclass of its own, a
``typing.Protocol``) or past :data:`MAX_TYPE_TESTS`: ``abc.get_cache_token()`` is guarded."""


_LIBRARYS: dict[tuple[type, type, types.CodeType], None] = {}
"""(ABC, class, code) of the tests made by a library's code of a library's classes: nothing
to note, whichever record pass makes them (30 000 tests in a PhiFlow step's record pass)."""
_MAX_SITES = 50_000


def _yours(klass: type) -> bool:
    known = _YOURS.get(klass)
    if known is None:
        module = sys.modules.get(klass.__module__)
        known = _YOURS[klass] = module is not None and user_module(module)
    return known


_YOURS: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def _own_check(cls: Any, name: str) -> bool:
    """Whether ``ABCMeta``'s ``name`` answers for ``cls`` (no metaclass overrides it)."""
    return next((k for k in type(cls).__mro__ if name in vars(k)), None) is abc.ABCMeta


def _noting(original: Callable[[Any, Any], bool]) -> Callable[[Any, Any], bool]:
    @functools.wraps(original)
    def check(cls: Any, tested: Any) -> bool:
        answer = original(cls, tested)
        notes = recording_notes()
        if notes is None:
            return answer
        klass = type(tested)
        pairs = notes.type_tests  # in the order of the first tests
        if (cls, klass) in pairs:
            return answer
        caller = sys._getframe(1)
        site = (cls, klass, caller.f_code)
        if site in _LIBRARYS:  # a library's test of its own classes, decided before
            return answer
        if _yours(cls) or _yours(klass) or from_user(caller):
            plain = _own_check(cls, "__instancecheck__") and _own_check(cls, "__subclasscheck__")
            full = len(pairs) >= MAX_TYPE_TESTS
            pairs[(cls, klass) if plain and not full else ANY_REGISTRATION] = answer
        elif not caller.f_code.co_filename.startswith(TORCH_DIR):  # (torch's: walked up)
            if len(_LIBRARYS) > _MAX_SITES:
                _LIBRARYS.clear()
            _LIBRARYS[site] = None
        return answer

    return check


class _Watch:
    def __init__(self) -> None:
        self._saved: list[tuple[str, Any, Any]] = []

    def install(self) -> None:
        name = "__instancecheck__"  # not __subclasscheck__: typing's protocols look at the
        original = vars(abc.ABCMeta)[name]  # module of the frame that calls their hook (an
        wrapper = _noting(original)  # extra frame there raised TypeError);
        setattr(abc.ABCMeta, name, wrapper)  # ``issubclass`` in code of yours guards the
        self._saved.append((name, original, wrapper))  # token (``_reads._environment``)

    def remove(self) -> None:
        while self._saved:
            name, original, wrapper = self._saved.pop()
            if vars(abc.ABCMeta).get(name) is wrapper:  # else someone patched it since
                setattr(abc.ABCMeta, name, original)


_WATCH = _Watch()
TYPE_TESTS = RefCounted(_WATCH.install, _WATCH.remove)
"""The record phase's patch: the ABC tests it makes are noted in the recording."""
