"""Stage 1 (record): the user's modules that the step imports while it runs.

A step may reach a module of the user's that no code names statically: by a name computed at
run time (``importlib.import_module(PREFIX + "settings")``, ``__import__(name)``) or by an
import that only some paths take. The code walk (:mod:`._reads._code_walk`) cannot see which
module that is; the record pass can. While it runs, ``builtins.__import__`` and
``importlib.import_module`` are wrapped: each module they return whose file is the user's
(:func:`._sources.is_user_file`) is noted in the recording, with the user's line that imported
it, and its data is guarded like a global's (``_reads``, NOTE [Python reads] in
docs/design.md). Other threads and phases pass straight through (the wrappers check the
current frame).
"""

from __future__ import annotations

import builtins
import functools
import importlib
import sys
import types
from collections.abc import Callable
from typing import Any

from ._context import Phase, current_frame
from ._patches import RefCounted
from ._sources import is_user_file

__all__ = ["IMPORTS_SEEN"]


def _note(caller: types.FrameType, *modules: Any) -> None:
    frame = current_frame()
    if frame is None or frame.phase is not Phase.RECORD or frame.recording is None:
        return
    seen = frame.recording.unguardable.imports
    for module in modules:
        name, file = getattr(module, "__name__", None), getattr(module, "__file__", None)
        if isinstance(name, str) and isinstance(file, str) and is_user_file(file):
            seen.setdefault(name, f"{caller.f_code.co_filename}:{caller.f_lineno}")


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
            _note(sys._getframe(1), module, named, *submodules)
        return module

    return __import__


def _watching_import_module(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def import_module(name: str, package: str | None = None) -> types.ModuleType:
        module = original(name, package)
        if current_frame() is not None:
            _note(sys._getframe(1), module)
        return module  # type: ignore[no-any-return]

    return import_module


class _Watch:
    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any, Any]] = []

    def install(self) -> None:
        targets = ((builtins, "__import__", _watching_import),
                   (importlib, "import_module", _watching_import_module))  # fmt: skip
        for owner, name, wrap in targets:
            original = getattr(owner, name)
            wrapper = wrap(original)
            setattr(owner, name, wrapper)
            self._saved.append((owner, name, original, wrapper))

    def remove(self) -> None:
        while self._saved:
            owner, name, original, wrapper = self._saved.pop()
            if getattr(owner, name) is wrapper:  # else someone patched it since: leave theirs
                setattr(owner, name, original)


_WATCH = _Watch()
IMPORTS_SEEN = RefCounted(_WATCH.install, _WATCH.remove)
"""The record phase's patch: user modules imported while the step runs are noted."""
