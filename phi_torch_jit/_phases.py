"""What is patched, process-wide, while each phase runs -- in one table.

A pass of a specialization (record, trace, compile; see :class:`._context.Phase`) needs
process-wide hooks: a global module pre-hook finds the modules that run, ``print`` is watched
for side effects, ``torch.autograd.Function.apply`` is intercepted, tensor-to-Python
conversions become value guards, torch's TorchScript notices are hidden, and PhiML's jit stack
sees our pass as its own. :data:`PATCHES` says which of them each phase installs, in the order
they are entered; :func:`phase` sets the frame and enters them. Each patch is reference counted
across threads (:class:`._patches.RefCounted`) and checks the current frame, so other threads
and eager code pass straight through. See NOTE [patches per phase] in docs/design.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from ._context import (
    Converted,
    CustomCalls,
    Frame,
    LibraryHooks,
    Phase,
    Recorder,
    entered,
    note_module_call,
)
from ._fast_paths import FAST_PATHS
from ._function import function_capture
from ._modules_seen import MODULES_SEEN
from ._patches import RefCounted
from ._side_effects import print_capture
from ._type_tests import TYPE_TESTS
from ._unguardable import UNGUARDABLE, RecordMode, generators_watched
from ._value_guards import conversion_capture
from ._warnings import torchscript_notices_hidden

__all__ = ["Patch", "PATCHES", "MODULE_HOOK", "phase", "recording", "tracing", "compiling"]


class _ModuleHook:
    """A process-wide forward pre-hook noting each module that runs in a record frame.

    Every module call in the process pays for a global hook, so it is only present during
    record passes (reference counted: see :mod:`._patches`).
    """

    def __init__(self) -> None:
        self._handle: RemovableHandle | None = None
        self._patch = RefCounted(self._install, self._remove)
        self.handle_id: int | None = None
        """Id of the installed hook in torch's global pre-hook dict (None if not installed);
        a plain attribute: module guards read it on every compiled call."""

    def active(self) -> AbstractContextManager[None]:
        return self._patch.active()

    def _install(self) -> None:
        self._handle = nn.modules.module.register_module_forward_pre_hook(_on_module_call)
        self.handle_id = self._handle.id

    def _remove(self) -> None:
        if self._handle is not None:
            self.handle_id = None
            self._handle.remove()
            self._handle = None


def _on_module_call(module: nn.Module, args: Any) -> None:
    note_module_call(module)


MODULE_HOOK = _ModuleHook()


@dataclass(frozen=True)
class Patch:
    """One process-wide patch and the phases that install it."""

    name: str
    """What it does, for docs and tests."""
    phases: frozenset[Phase]
    """The phases it is active in."""
    enter: Callable[[Frame], AbstractContextManager[Any] | None]
    """The context manager to enter for a frame (None: not needed for this frame)."""


_ALL = frozenset(Phase)
_RECORD = frozenset({Phase.RECORD})

PATCHES: tuple[Patch, ...] = (
    Patch("module pre-hook: modules that run join the recording", _RECORD,
          lambda f: MODULE_HOOK.active()),
    Patch("print: noted in the record pass, dropped in the trace pass (once per compile)",
          frozenset({Phase.RECORD, Phase.TRACE}), lambda f: print_capture()),
    Patch("Function.apply: autograd.Function calls are captured", _ALL,
          lambda f: function_capture()),
    Patch("tensor-to-Python conversions of user code become value guards",
          frozenset({Phase.TRACE}),
          lambda f: conversion_capture(f) if f.conversions is not None else None),
    Patch("torch's TorchScript deprecation notices are hidden", _ALL,
          lambda f: torchscript_notices_hidden()),
    Patch("registered libraries' pass hooks (PhiML's custom gradients see this pass as its jit)",
          frozenset({Phase.RECORD, Phase.TRACE}),
          lambda f: (f.libraries.active(f.phase is Phase.RECORD)
                     if f.libraries is not None else None)),
    Patch("random, clocks, torch RNG state, grad mode, autograd, tensor hooks: calls "
          "that no compiled program repeats are noted", _RECORD,
          lambda f: UNGUARDABLE.active()),
    Patch("Python's and NumPy's global generators: a draw however reached is noted (their "
          "states before and after)", _RECORD, lambda f: generators_watched()),
    Patch("modules: the user's modules the step imports, and what it reads of them, join "
          "its reads", _RECORD, lambda f: MODULES_SEEN.active()),
    Patch("isinstance/issubclass against ABCs: the pairs tested join its reads", _RECORD,
          lambda f: TYPE_TESTS.active()),
    Patch("torch's fast-path check in its nn modules answers as without our mode; a fast path "
          "taken is noted", _RECORD, lambda f: FAST_PATHS.active()),
    Patch("torch calls given a generator= object and Python reads of requires_grad are noted "
          "(this thread's mode stack)", _RECORD,
          lambda f: RecordMode()),
)  # fmt: skip
"""Every process-wide patch, in the order a phase enters them (and leaves them reversed)."""


@contextmanager
def phase(frame: Frame) -> Iterator[Frame]:
    """Make ``frame`` current and install its phase's patches while the block runs."""
    with entered(frame), ExitStack() as stack:
        for patch in PATCHES:
            if frame.phase in patch.phases:
                manager = patch.enter(frame)
                if manager is not None:
                    stack.enter_context(manager)
        yield frame


def recording(owner: str, recording: Recorder) -> AbstractContextManager[Frame]:
    """Stage 1: the record phase for ``owner``; ``recording`` collects what runs."""
    return phase(Frame(Phase.RECORD, owner, recording=recording, libraries=recording.libraries))


def tracing(
    owner: str,
    cursor: CustomCalls,
    conversions: list[Converted] | None,
    libraries: LibraryHooks | None,
) -> AbstractContextManager[Frame]:
    """Stage 4: the trace phase for ``owner``; ``cursor`` replays the recording.

    ``conversions``, if not None, collects the tensor-to-Python conversions of user code.
    """
    frame = Frame(Phase.TRACE, owner, cursor=cursor, conversions=conversions, libraries=libraries)
    return phase(frame)


def compiling(owner: str, nested: CustomCalls) -> AbstractContextManager[Frame]:
    """Stage 2: a custom function's body is compiled; custom functions it calls are nested."""
    return phase(Frame(Phase.COMPILE, owner, nested=nested))
