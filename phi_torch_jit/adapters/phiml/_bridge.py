"""PhiML's torch backend sees our record and trace passes as its own jit (NOTE [PhiML bridge]).

:class:`PhiMLBridge` is the adapter's pass hooks (``extend.PassHooks``): one per
specialization, entered around its record and trace passes.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from ..._compat import get_tracing_state
from ..._context import current_frame, note_module_call
from ..._patches import RefCounted
from ._backend_patches import LOOPS, SPARSE_COO
from ._checks import CHECKING, CHECKS, OUTER_TAPES, Deferred, open_tapes, tapes_set_aside
from ._graph_capture import VIEW
from ._values import disassemble

__all__ = ["PhiMLBridge", "phiml_jit_tracing"]


class PhiMLBridge:
    """Lets PhiML's torch backend treat a phi_torch_jit specialization as its own jit.

    PhiML's custom gradients (e.g. the implicit pressure solve) keep per-signature output
    mappings and, under tracing, expect the jit that traces them to hand back the mapping
    recorded on the untraced pass. PhiML asks the last entry of its ``CURRENT_JIT_CALLS``
    list; while our record and trace passes run, that entry is this object. See NOTE
    [PhiML bridge] in docs/design.md.
    """

    is_phi_torch_jit_bridge = True
    """How :mod:`._phiml_graph_capture` knows the jit on PhiML's stack is ours."""

    def __init__(self) -> None:
        self.recording = False
        """Whether the pass on PhiML's stack now is the record pass (values are real)."""
        self.called_modules: set[Any] = set()
        """Modules PhiML's networks registered (forwarded to register_module_call)."""
        self._calls: list[Any] = []
        self._after_record: list[tuple[Any, tuple[Any, ...]]] = []
        self._replayed = 0
        self._calls_seen = 0
        self.outer_tapes: tuple[Any, ...] = ()
        """PhiML ``SolveTape``s open when the pass began: the record pass and compiled calls
        fill them; the trace pass fills only the tapes the function opens itself."""

    @property
    def used(self) -> bool:
        """Whether PhiML made custom-gradient calls in the record pass."""
        return bool(self._calls)

    def record_autograd_function_call(
        self, function: Any, args: Any, output: Any, ext_cache: Any, jit_compile: bool = True
    ) -> None:
        """PhiML, untraced pass: a custom-gradient call happened (our adapter recorded it)."""
        self._calls.append(ext_cache)

    def extract_and_call(self, tensors: tuple[Any, ...], runnable: Any) -> None:
        """PhiML, traced pass: ``math.when_available(runnable, *tensors)`` waits for values.

        The tensors' torch natives become extra outputs of the program, and every compiled
        call rebuilds the PhiML tensors from them and calls ``runnable`` (as PhiML's jit does
        after its calls). In the record pass the values are available and PhiML calls
        ``runnable`` at once."""
        if phiml_jit_tracing():  # under install(): PhiML's own jit extracts and calls it
            return
        if self.recording:  # real values: called when the record pass has returned
            self._after_record.append((runnable, tensors))
            return
        frame = current_frame()
        if frame is None:
            raise RuntimeError("phi_torch_jit: PhiML deferred a call outside a trace")
        natives: list[torch.Tensor] = []
        key = disassemble(tuple(tensors), natives)
        frame.outputs.deferred.append(Deferred(key, runnable, len(natives)))
        frame.outputs.deferred_tensors.extend(natives)

    @property
    def _tracing_in_key(self) -> Any:
        """What PhiML's ``perf_counter`` asks a tracing jit for: its backend."""
        from phiml.backend.torch import TORCH

        return types.SimpleNamespace(backend=TORCH)

    def get_compiled_function(self, function: Any, args: Any) -> tuple[Any, Any]:
        """PhiML, traced pass: return (what to apply, the recorded external cache)."""
        if self._replayed >= len(self._calls):
            raise RuntimeError("phi_torch_jit: PhiML made more custom-gradient calls while tracing")
        ext_cache = self._calls[self._replayed]
        self._replayed += 1
        return function, ext_cache  # its apply() reaches our replay through the interception

    @contextmanager
    def active(self, recording: bool = False) -> Iterator[None]:
        """Make PhiML see this bridge as the current jit while the block runs (if PhiML is used).

        ``recording``: the record pass. PhiML treats every value as unavailable while a jit is
        on its stack, in both passes, as under its own jit: the record pass then takes the same
        paths as the trace (e.g. a solve matrix built from traced geometry values is a torch
        tensor in both). Two things still see the record pass's real values: convergence
        checks (``NotConverged`` on the same calls as eager code) and ``math.when_available``
        callbacks, called with the real values when the record pass has returned.
        """
        backend = sys.modules.get("phiml.backend.torch._torch_backend")
        if backend is None:
            yield
            return
        self._replayed = 0
        self.recording = recording
        self.outer_tapes = open_tapes()
        outer = OUTER_TAPES.set(self.outer_tapes)
        self._after_record = []
        stack = backend.CURRENT_JIT_CALLS
        stack.append(self)
        tracing = sys.modules["phiml.math._functional"]._TRACING_JIT
        tracing.append(self)  # when_available asks PhiML's own jit stack
        try:
            with _AVAILABILITY.active(), CHECKS.active(), LOOPS.active(), VIEW.active():
                with SPARSE_COO.active(), _FUNCTION_SOLVES.active():
                    yield
        finally:
            stack.remove(self)
            tracing.remove(self)
            OUTER_TAPES.reset(outer)
            self._forward_modules()
        for runnable, tensors in self._after_record:  # the record pass returned
            runnable(*tensors)

    def outside_user_call(self) -> AbstractContextManager[None]:
        """While the block runs, PhiML's open ``SolveTape``s are set aside: for a run of the
        program that is not a call of the user's (a backend's warm-up on the trace inputs)."""
        return tapes_set_aside() if self.used else nullcontext()

    def _forward_modules(self) -> None:
        for module in self.called_modules:
            note_module_call(module)


class _Availability:
    """``TorchBackend.is_available`` that says True for the convergence checks of our record
    passes (see :meth:`PhiMLBridge.active`); installed while any bridge is active."""

    def __init__(self) -> None:
        self._original: Any = None

    def install(self) -> None:
        from phiml.backend.torch import _torch_backend as backend

        original = self._original = backend.TorchBackend.__dict__["is_available"]

        def is_available(self_: Any, tensor: Any) -> bool:
            stack = backend.CURRENT_JIT_CALLS
            recording = stack and isinstance(stack[-1], PhiMLBridge) and stack[-1].recording
            if recording and CHECKING.get():  # a record pass's convergence check: real values
                return get_tracing_state() is None
            return bool(original(self_, tensor))

        backend.TorchBackend.is_available = is_available

    def remove(self) -> None:
        from phiml.backend.torch import _torch_backend as backend

        backend.TorchBackend.is_available = self._original


def phiml_jit_tracing() -> bool:
    """Whether PhiML's own ``jit_compile`` is tracing (phi_torch_jit runs under ``install()``)."""
    functional = sys.modules.get("phiml.math._functional")
    return functional is not None and any(
        not isinstance(j, PhiMLBridge) for j in functional._TRACING_JIT
    )


_AVAILABILITY_PATCH = _Availability()
_AVAILABILITY = RefCounted(_AVAILABILITY_PATCH.install, _AVAILABILITY_PATCH.remove)


class _FunctionSolves:
    """``TorchBackend.conjugate_gradient`` that solves with a linear *function* in our record
    passes as eagerly, where PhiML's refuses under a jit.

    PhiML's torch CG takes a function (a matrix-free ``solve_linear`` of an undecorated
    function) only where its values are available, and asserts otherwise: "JIT-compiling
    conjugate_gradient with PyTorch is not yet supported for arbitrary functions". A record pass
    holds real values, but PhiML sees this bridge as a jit, so a step that eager code runs
    raised (probe round 34). In a record pass, outside a TorchScript trace, it runs PhiML's
    generic CG, as eager code does; its ``while_loop`` then makes the specialization run
    eagerly, warned (``_backend_patches.LOOPS``). Traces and PhiML's own jit are refused as
    before."""

    def __init__(self) -> None:
        self._original: Any = None

    def install(self) -> None:
        from phiml.backend._backend import Backend
        from phiml.backend.torch import _torch_backend as backend

        original = self._original = backend.TorchBackend.__dict__["conjugate_gradient"]

        def conjugate_gradient(self_: Any, lin: Any, *args: Any) -> Any:
            stack = backend.CURRENT_JIT_CALLS
            recording = stack and isinstance(stack[-1], PhiMLBridge) and stack[-1].recording
            if callable(lin) and recording and get_tracing_state() is None:
                return Backend.conjugate_gradient(self_, lin, *args)
            return original(self_, lin, *args)

        backend.TorchBackend.conjugate_gradient = conjugate_gradient

    def remove(self) -> None:
        from phiml.backend.torch import _torch_backend as backend

        backend.TorchBackend.conjugate_gradient = self._original


_FUNCTION_SOLVES_PATCH = _FunctionSolves()
_FUNCTION_SOLVES = RefCounted(_FUNCTION_SOLVES_PATCH.install, _FUNCTION_SOLVES_PATCH.remove)
