"""Stage 1 (record): the user's modules the step reaches while it runs, and what it reads there.

A step may reach a module of the user's that no code names statically: by a name computed at
run time (``importlib.import_module(PREFIX + "settings")``, ``__import__(name)``,
``sys.modules[__name__]``, ``sys.modules[name]``) or through source text built at run time
(``eval(NAME + " * 2")``). The code walk (:mod:`._reads._code_walk`) cannot see which module or
which name that is; the record pass can. While it runs:

* ``builtins.__import__`` and ``importlib.import_module`` are wrapped: each module they return
  whose file is the user's (:func:`._sources.is_user_file`) is noted, and its public data is
  guarded like a global's;
* the user's modules (those of plain :class:`types.ModuleType`) take a watching class: each
  attribute read on one (``module.GRAVITY``, ``getattr(module, "GRAVITY")``) is noted, and that
  attribute is guarded (a function or class read there is walked like one a global names); a
  read of the module's ``__dict__`` (``vars(module)["GRAVITY"]``) notes the string constants of
  the reading code that are its keys;
* ``eval`` and ``exec`` are wrapped: the names that the evaluated source loads from a user
  module's globals are noted and guarded.

Each note carries the user's line that made it; reads and guards happen in ``_reads``
(NOTE [Python reads] in docs/design.md). Other threads and phases pass straight through (the
wrappers check the current frame); the watching class is put back when the last record pass
ends.
"""

from __future__ import annotations

import builtins
import dis
import functools
import importlib
import sys
import types
from collections.abc import Callable
from typing import Any

from ._context import Phase, current_frame
from ._patches import RefCounted
from ._sources import OWN_DIR, is_user_file, user_module

__all__ = ["MODULES_SEEN"]


def _seen() -> Any:
    """This thread's recording's :class:`._unguardable.Unguardable`, or None outside a record
    pass."""
    frame = current_frame()
    if frame is None or frame.phase is not Phase.RECORD or frame.recording is None:
        return None
    return frame.recording.unguardable


def _user(module: Any) -> bool:
    """A module of the user's: a file of theirs, or one made at run time (``user_module``)."""
    return isinstance(module, types.ModuleType) and user_module(module)


def _note_imported(caller: types.FrameType, *modules: Any) -> None:
    seen = _seen()
    if seen is None:
        return
    for module in modules:
        name = getattr(module, "__name__", None)
        if isinstance(name, str) and _user(module):
            seen.imports.setdefault(name, f"{caller.f_code.co_filename}:{caller.f_lineno}")


def _note_object(caller: types.FrameType, name: str, value: Any) -> None:
    """An object of a class of yours registered in ``sys.modules`` as a module
    (``sys.modules[NAME] = Config()``) and imported by ``name``: noted like a module."""
    seen = _seen()
    if seen is not None and not isinstance(value, types.ModuleType) and _yours(type(value)):
        seen.imports.setdefault(name, f"{caller.f_code.co_filename}:{caller.f_lineno}")


def _yours(klass: type) -> bool:
    module = sys.modules.get(klass.__module__)
    return module is not None and _user(module)


def _note_read(caller: types.FrameType, module: str, names: Any) -> None:
    """Note that code at ``caller`` read ``names`` of the user's ``module``."""
    seen = _seen()
    if seen is None or caller.f_code.co_filename.startswith(OWN_DIR):
        return
    where = f"{caller.f_code.co_filename}:{caller.f_lineno}"
    for name in names:
        seen.module_reads.setdefault((module, name), where)


def _watching_import(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __import__(  # it stands in for the builtin
        name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0
    ) -> Any:
        module = original(name, globals, locals, fromlist, level)
        if current_frame() is not None:
            own = getattr(module, "__name__", "")
            named = sys.modules.get(name) if level == 0 else None
            submodules = [sys.modules.get(f"{own}.{item}") for item in fromlist or ()
                          if isinstance(item, str)]  # fmt: skip
            _note_imported(sys._getframe(1), module, named, *submodules)
            _note_object(sys._getframe(1), name, module)
        return module

    return __import__


def _watching_import_module(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def import_module(name: str, package: str | None = None) -> types.ModuleType:
        module = original(name, package)
        if current_frame() is not None:
            _note_imported(sys._getframe(1), module)
            _note_object(sys._getframe(1), name, module)
        return module  # type: ignore[no-any-return]

    return import_module


def _watching_evaluation(original: Callable[..., Any]) -> Callable[..., Any]:
    """``eval`` or ``exec``, noting the names its source loads from a user module's globals.
    Called without globals, it runs in its caller's globals and locals, as the builtin does."""

    @functools.wraps(original)
    def evaluate(source: Any, globals: Any = None, locals: Any = None, **kwargs: Any) -> Any:
        caller = sys._getframe(1)
        if globals is None:
            globals = caller.f_globals
            locals = caller.f_locals if locals is None else locals
        if current_frame() is not None and isinstance(globals, dict):
            module = sys.modules.get(globals.get("__name__", ""))  # type: ignore[arg-type]
            if module is not None and vars(module) is globals and _user(module):
                _note_read(caller, module.__name__, [n for n in _loaded(source) if n in globals])
        return original(source, globals, locals, **kwargs)

    return evaluate


def _loaded(source: Any) -> list[str]:
    """The names code (or source text) loads, nested code included; none if it is no code."""
    if isinstance(source, (str, bytes)):
        for mode in ("eval", "exec"):
            try:
                source = compile(source, "<source>", mode)
                break
            except Exception:  # not this mode (or not source): the builtin will say why
                continue
    if not isinstance(source, types.CodeType):
        return []
    found: list[str] = []
    pending = [source]
    while pending:
        code = pending.pop()
        found += code.co_names
        pending += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return found


class _WatchedModule(types.ModuleType):
    """The class a user module has while a record pass runs: its attribute reads are noted."""

    def __getattribute__(self, name: str) -> Any:
        try:
            value = super().__getattribute__(name)
        except AttributeError:  # getattr(module, "SCALE", 1.0): it must stay undefined
            if not name.startswith("__") and current_frame() is not None:
                _note_read(sys._getframe(1), super().__getattribute__("__name__"), (name,))
            raise
        if (name.startswith("__") and name != "__dict__") or current_frame() is None:
            return value
        caller = sys._getframe(1)
        if name == "__dict__":  # vars(module)["GRAVITY"], .get("K", 1.0): the code's constants
            if is_user_file(caller.f_code.co_filename):
                own = super().__getattribute__("__name__")
                _note_read(caller, own, [c for c in _constants(caller.f_code) if c.isidentifier()])
        else:
            _note_read(caller, super().__getattribute__("__name__"), (name,))
        return value


def _constants(code: types.CodeType) -> list[str]:
    return [i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_CONST"
            and isinstance(i.argval, str) and not i.argval.startswith("__")]  # fmt: skip


class _Watch:
    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any, Any]] = []
        self._classed: list[types.ModuleType] = []

    def install(self) -> None:
        targets = ((builtins, "__import__", _watching_import),
                   (importlib, "import_module", _watching_import_module),
                   (builtins, "eval", _watching_evaluation),
                   (builtins, "exec", _watching_evaluation))  # fmt: skip
        for owner, name, wrap in targets:
            original = getattr(owner, name)
            wrapper = wrap(original)
            setattr(owner, name, wrapper)
            self._saved.append((owner, name, original, wrapper))
        for module in list(sys.modules.values()):
            if type(module) is types.ModuleType and _user(module):
                module.__class__ = _WatchedModule
                self._classed.append(module)

    def remove(self) -> None:
        while self._classed:
            module = self._classed.pop()
            if type(module) is _WatchedModule:  # else its own code changed it since: leave it
                module.__class__ = types.ModuleType  # type: ignore[assignment]
        while self._saved:
            owner, name, original, wrapper = self._saved.pop()
            if getattr(owner, name) is wrapper:  # else someone patched it since: leave theirs
                setattr(owner, name, original)


_WATCH = _Watch()
MODULES_SEEN = RefCounted(_WATCH.install, _WATCH.remove)
"""The record phase's patch: the user modules the step imports and the names it reads of
them are noted."""
