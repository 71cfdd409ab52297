"""PhiML's custom gradients inside a graph capture (engines "compile" and "auto"), no TorchScript.

PhiML's torch backend tells the untraced pass of its jit from the traced one by TorchScript's
tracing state (``torch._C._get_tracing_state()``): untraced, a custom-gradient call records
itself with the jit on PhiML's stack; traced, it asks that jit for what was recorded and hands
the recorded output mapping back to the PhiML function (``on_call_skipped``). A graph capture
(``make_fx``) sets no TorchScript state, so without this module PhiML took our trace pass for a
second record pass: it looked up its output mapping under the trace pass's key, which is a
different key (the trace runs on copies of the inputs), and failed.

While our trace pass is on PhiML's stack and no TorchScript trace runs, :data:`VIEW` makes
``CustomGradientFunction.__call__`` see a tracing state -- for the calling thread only, and
only for the name ``torch`` inside PhiML's torch backend, for the length of that call. PhiML
then takes the path it takes under TorchScript: the bridge hands back the recorded call, and
the Function's ``apply`` reaches our replay (NOTE [PhiML bridge] in docs/design.md).
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..._compat import TORCH_C, get_tracing_state
from ..._patches import RefCounted

__all__ = ["VIEW", "capturing", "seen_as_traced"]

_BACKEND = "phiml.backend.torch._torch_backend"
_FUNCTIONAL = "phiml.math._functional"


class _Local(threading.local):
    traced: bool = False
    """Whether PhiML, on this thread, is to see a tracing state now."""


_LOCAL = _Local()


class _TracingState:
    """Stands in for a TorchScript tracing state: PhiML only tests it for None."""

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "<phi_torch_jit graph capture>"


_STATE = _TracingState()


def _tracing_state() -> Any:
    if _LOCAL.traced:
        return _STATE
    return get_tracing_state()


class _TorchC(types.ModuleType):
    """torch's C module as PhiML's backend sees it: the tracing state answers for our
    capture."""

    def __getattr__(self, name: str) -> Any:
        if name == "_get_tracing_state":
            return _tracing_state
        return getattr(TORCH_C.find(), name)


class _Torch(types.ModuleType):
    """``torch`` as PhiML's backend sees it while the view is installed."""

    def __getattr__(self, name: str) -> Any:
        if name == "_C":
            return _TORCH_C
        return getattr(torch, name)


_TORCH_C = _TorchC("torch._C")
_TORCH = _Torch("torch")


def capturing() -> bool:
    """Whether a PhiML call now happens in our trace pass under a graph capture: our bridge is
    the jit on PhiML's stack, in its trace pass, and no TorchScript trace runs."""
    backend = sys.modules.get(_BACKEND)
    if backend is None or get_tracing_state() is not None:
        return False
    stack = backend.CURRENT_JIT_CALLS
    if not stack:
        return False
    top = stack[-1]
    return getattr(top, "is_phi_torch_jit_bridge", False) and not top.recording


def _ours_on_top() -> bool:
    """Whether our bridge is the jit on PhiML's stack (a record or a trace pass of ours)."""
    backend = sys.modules.get(_BACKEND)
    stack: list[Any] = backend.CURRENT_JIT_CALLS if backend is not None else []
    return bool(stack) and getattr(stack[-1], "is_phi_torch_jit_bridge", False)


@contextmanager
def _fresh_classes(function: Any) -> Iterator[None]:
    """PhiML's custom-gradient ``function`` makes a new ``autograd.Function`` class for this
    call, as it does for auxiliary arguments it has not seen.

    PhiML keeps a class per key and compares the auxiliary arguments by value: a call equal to
    an earlier one (eager code's, or an earlier pass's) got that call's class, holding that
    call's tensors, which our passes then took for constants (probe round 34: a 0-dim tensor
    argument changed in place was baked by a compiled backend from the third call on). A class
    made in the pass holds the pass's own values, which become inputs of its custom function
    (``_functions.closure_roots``). PhiML's cache is set aside for the call, not changed."""
    kept = getattr(function, "traces", None)
    if type(kept) is not dict:
        yield
        return
    function.traces = {}
    try:
        yield
    finally:
        function.traces = kept


class _View:
    """Installs the patched ``CustomGradientFunction.__call__`` and PhiML's view of torch."""

    def __init__(self) -> None:
        self._original: Any = None
        self._torch: Any = None

    def install(self) -> None:
        functional = sys.modules[_FUNCTIONAL]
        backend: Any = sys.modules[_BACKEND]
        cls = functional.CustomGradientFunction
        original = self._original = cls.__dict__["__call__"]
        self._torch = backend.torch
        backend.torch = _TORCH  # answers as torch does, except under _LOCAL.traced

        def __call__(self_: Any, *args: Any, **kwargs: Any) -> Any:
            if _LOCAL.traced or not _ours_on_top():
                return original(self_, *args, **kwargs)
            with _fresh_classes(self_):
                if not capturing():
                    return original(self_, *args, **kwargs)
                _LOCAL.traced = True
                try:
                    return original(self_, *args, **kwargs)
                finally:
                    _LOCAL.traced = False

        cls.__call__ = __call__

    def remove(self) -> None:
        functional = sys.modules[_FUNCTIONAL]
        functional.CustomGradientFunction.__call__ = self._original
        backend: Any = sys.modules[_BACKEND]
        backend.torch = self._torch


_VIEW = _View()
VIEW = RefCounted(_VIEW.install, _VIEW.remove)
"""Active while any PhiML bridge is (``PhiMLBridge.active``); see the module docstring."""


@contextmanager
def seen_as_traced() -> Iterator[None]:
    """PhiML's torch backend sees a tracing state on this thread while the block runs: a solve's
    body captured whole (``_solve_ops``) takes the paths it takes under PhiML's own jit."""
    previous = _LOCAL.traced
    with VIEW.active():
        _LOCAL.traced = True
        try:
            yield
        finally:
            _LOCAL.traced = previous
