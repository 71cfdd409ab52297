"""Engine ``"torchscript"``: ``torch.jit.trace``, scripting where tracing would bake.

Tracing records the operations one run executes. It is faithful unless
Python control flow depends on tensor values; torch reports those spots as
``TracerWarning``. For a custom function's forward such a warning means the
trace would replay a fixed iteration count (a CG loop that gives NaN for a
fluid at rest), so the engine does not use it: it scripts the function
(keeping the loop) when the function is scriptable and reproduces the
recorded outputs, and otherwise runs it as Python inside the compiled
program. For the wrapper module the warnings are passed on to the user.

``torch.jit.trace`` is deprecated (DeprecationWarning in torch 2.13,
FutureWarning later); those warnings are dropped here, once per compile, and
never reach the user. Everything else torch warns about is re-emitted.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .._compat import (
    TracerWarning,
    graph_executor_optimize,
    set_graph_executor_optimize,
    torchscript_available,
)
from .._libraries import harmless_tracer_warning, reads_input_shape
from .._sources import TORCH_DIR, is_user_file
from .._warnings import describe_warning, is_torchscript_notice, reemit
from ..errors import RunEagerly, TraceError
from .base import (
    RANDOM_OPS,
    CompiledFunction,
    CompiledModule,
    Engine,
    FunctionTarget,
    captured_tensor_message,
)

__all__ = ["TorchScriptEngine", "trace_graph", "UNAVAILABLE"]

UNAVAILABLE = (
    "TorchScript is unavailable in this torch (torch.jit.trace does not work); use engine "
    "'compile' or 'auto', which do not need it"
)

# warnings.catch_warnings swaps a process-wide list; serialize our uses of it.
_WARNINGS_LOCK = threading.RLock()

logger = logging.getLogger("phi_torch_jit")

_CAPTURED_CONSTANT = "Cannot insert a Tensor that requires grad as a constant"


@contextmanager
def _caught_warnings() -> Iterator[list[warnings.WarningMessage]]:
    with _WARNINGS_LOCK, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings._showwarnmsg_impl = functools.partial(_attributed, caught)  # type: ignore[attr-defined]
        yield caught


def _attributed(caught: list[warnings.WarningMessage], message: warnings.WarningMessage) -> None:
    """Record ``message`` at the line that called the op, where a torch-function mode of
    torch's own (:data:`_MODE_FRAMES`) called it on that line's behalf."""
    if message.filename in _MODE_FRAMES:
        frame: types.FrameType | None = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename != message.filename:
            frame = frame.f_back  # down to the mode's frame, which warnings named
        while frame is not None and frame.f_code.co_filename in _MODE_FRAMES:
            frame = frame.f_back
        if frame is not None:
            message.filename, message.lineno = frame.f_code.co_filename, frame.f_lineno
    caught.append(message)


_MODE_FRAMES = frozenset(
    os.path.join(TORCH_DIR, *parts) for parts in (("utils", "_device.py"), ("overrides.py",))
)
"""torch's own torch-function modes (``torch.set_default_device("cuda")``, ``with
torch.device(...)``: a DeviceContext) call each op from their own frame, so a tracer warning
raised by the user's ``bool(rs > tol)`` is attributed there. Taken for torch's own check, the
CG loop of a custom function was traced with a fixed iteration count (found on a GPU, where
the suite sets the default device). :func:`_attributed` moves such warnings to the line that
called the op (the user's, or a library's); one it cannot place counts as the user's."""


def _is_library_check(w: warnings.WarningMessage) -> bool:
    """A tracer warning that cannot mean a wrong result (see NOTE [tracer warnings]).

    Raised by torch's own Python (e.g. BatchNorm's batch-size check): those convert shapes,
    and shapes are part of the cache key. Or a registered library's own (PhiML turning its numpy
    constants into tensors: those constants are part of the cache key too, compared by value).
    """
    if not issubclass(w.category, TracerWarning):
        return False
    if w.filename.startswith(TORCH_DIR) and w.filename not in _MODE_FRAMES:
        return True
    return harmless_tracer_warning(w)


_VALUE_SHAPED = ("aten::nonzero", "aten::unique", "aten::_unique", "aten::masked_select",
                 "aten::repeat_interleave", "aten::bincount", "aten::index")  # fmt: skip
"""TorchScript ops whose output shape may depend on tensor values (``aten::index``: a mask)."""


def _has_value_dependent_shapes(graph: Any) -> bool:
    return any(node.kind().startswith(_VALUE_SHAPED) for node in graph.nodes())


def _refuse_baked_sizes(tracer: list[warnings.WarningMessage], graph: Any, label: str) -> None:
    """A tracer warning of the user's own code (``len(i)``, iterating over a tensor) in a graph
    with an op whose output shape depends on values (``x.nonzero()``): the trace baked a size
    that differs on the next call (torchode's adjoint crashed). Sizes of inputs are part of
    the key, so without such an op the warning is harmless. The caller runs it eagerly."""
    user = [w for w in tracer if is_user_file(w.filename) or w.filename in _MODE_FRAMES]
    if user and _has_value_dependent_shapes(graph):
        first = user[0]
        raise TraceError(
            f"phi_torch_jit: {label} the trace would bake a size that depends on tensor values "
            f"at {first.filename}:{first.lineno} ({str(first.message).split('.')[0]}); use "
            "x.shape[0] and tensor operations"
        )


def _sort_warnings(
    caught: list[warnings.WarningMessage],
) -> tuple[list[warnings.WarningMessage], list[warnings.WarningMessage]]:
    """Split into (tracer warnings, other warnings); deprecation notices are dropped."""
    kept = [w for w in caught if not is_torchscript_notice(w)]
    for w in kept:
        if _is_library_check(w):
            logger.debug(
                "phi_torch_jit: ignored tracer warning from torch: %s", describe_warning(w)
            )
    kept = [w for w in kept if not _is_library_check(w)]
    tracer = [w for w in kept if issubclass(w.category, TracerWarning)]
    return tracer, [w for w in kept if w not in tracer]


class _AsTuple:
    """Calls a scripted function and returns its result as a tuple."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.fn(*args)
        return out if isinstance(out, tuple) else (out,)


def _reproduces(actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> bool:
    if len(actual) != len(expected):
        return False
    for a, e in zip(actual, expected):
        if not isinstance(a, torch.Tensor) or a.shape != e.shape or a.dtype != e.dtype:
            return False
        scale = float(e.detach().abs().max()) if e.numel() and e.is_floating_point() else 1.0
        if not torch.allclose(a, e, rtol=1e-4, atol=1e-5 * max(scale, 1.0), equal_nan=True):
            return False
    return True


def _as_function(fn: Any) -> Any:
    """torch.jit.trace wants a Python function (it reads its name); wrap callable objects."""
    if isinstance(fn, types.FunctionType):
        return fn

    def flat(*tensors: torch.Tensor) -> Any:
        return fn(*tensors)

    flat.__name__ = flat.__qualname__ = type(fn).__name__
    return flat


_MAKES_COMPLEX = ("fft", "complex", "polar", "stft")


def _has_complex(graph: Any, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a traced program may hold complex tensors: complex inputs, parameters or
    buffers, or an op that makes them (the traced graph's types do not say)."""
    if any(t.is_complex() for t in tensors):
        return True
    return any(any(m in node.kind() for m in _MAKES_COMPLEX) for node in graph.nodes())


def _uses_rng(graph: Any) -> bool:
    """Whether a traced graph may draw random numbers (custom and Python ops count as may)."""
    for node in graph.nodes():
        kind = node.kind()
        if kind.startswith(("phi_torch_jit::", "prim::PythonOp")) or any(
            r in kind for r in RANDOM_OPS
        ):
            return True
    return False


def _differentiable(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a program may be differentiated (an input, parameter or buffer requires grad).

    The optimizing executor differentiates the subgraphs it fuses symbolically; on a PhiFlow
    smoke step in an open box (pressure solve, MacCormack advection) the gradient it gave
    from the second compiled call on was off by 1.7 where its largest entry is 4.2 (torch
    2.13; unoptimized and eager agree to 5e-7). Programs that can be differentiated therefore
    run unoptimized; on this CPU the optimizer made no measurable difference to a training
    step (NOTE [TorchScript optimizations])."""
    return any(t.requires_grad for t in tensors)


def _draws_twice(graph: Any) -> bool:
    """Whether a traced graph has more than one node that may draw random numbers.

    The optimizing executor slices differentiable nodes into subgraphs and moves nodes past
    others that they do not depend on; the global RNG is no dependency to it, so two draws
    on independent branches (an encoder's dropout, a decoder's attention dropout) may swap,
    and every later draw shifts: an ``nn.Transformer`` trained differently from the second
    compiled call on (found by the corpus). Such programs run unoptimized."""
    draws = 0
    for node in graph.nodes():
        kind = node.kind()
        if kind.startswith("prim::PythonOp") or any(r in kind for r in RANDOM_OPS):
            draws += 1
            if draws > 1:
                return True
    return False


class _Unoptimized:
    """Runs a TorchScript callable with the graph executor's optimizations off (this thread).

    The optimizing executor differentiates fused subgraphs symbolically, and on torch 2.13
    that returns wrong gradients for complex tensors from the second call on (found by the
    property tests); it also reorders random draws (:func:`_draws_twice`). See
    NOTE [TorchScript optimizations] in docs/design.md.
    """

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        previous = graph_executor_optimize()
        set_graph_executor_optimize(False)
        try:
            return self.fn(*args)
        finally:
            set_graph_executor_optimize(previous)


class TorchScriptEngine(Engine):
    """Compiles with ``torch.jit.trace``; scripts or falls back to Python where tracing bakes.

    Args:
        optimize: whether TorchScript's graph executor may optimize compiled programs
            (fusion, symbolic autodiff). ``None`` (default): yes, except for programs with
            complex tensors, whose gradients it gets wrong on torch 2.13, and programs with
            more than one random draw, which it may reorder. ``True`` or
            ``False`` force it either way (``False`` costs about 1.3 us per call).
    """

    name = "torchscript"

    def __init__(self, optimize: bool | None = None) -> None:
        self.optimize = optimize

    def _executable(self, fn: Any, graph: Any = None, tensors: Sequence[torch.Tensor] = ()) -> Any:
        optimize = self.optimize
        if optimize is None:
            optimize = graph is None or not (
                _has_complex(graph, tensors) or _draws_twice(graph) or _differentiable(tensors)
            )
        return fn if optimize else _Unoptimized(fn)

    def compile_function(self, target: FunctionTarget) -> CompiledFunction:
        if not torchscript_available():
            return CompiledFunction(target.fn, "python", "TorchScript is unavailable in this torch")
        with _caught_warnings() as caught:
            try:
                traced = torch.jit.trace(
                    _as_function(target.fn),
                    target.example_inputs,
                    check_trace=False,
                    _store_inputs=False,
                )
            except Exception as error:  # anything the tracer cannot follow
                traced, failure = None, f"tracing failed: {type(error).__name__}: {error}"
        tracer, other = _sort_warnings(caught)
        reemit(other)
        if traced is not None and tracer and all(reads_input_shape(w) for w in tracer):
            if not _has_value_dependent_shapes(traced.inlined_graph):
                tracer = []
        if traced is not None and not tracer:  # runs below autograd: nothing to differentiate
            return CompiledFunction(self._executable(traced), "traced")
        if traced is not None:
            failure = "its Python control flow depends on tensor values: " + describe_warning(
                tracer[0]
            )
        return self._without_trace(target, failure)

    def _without_trace(self, target: FunctionTarget, reason: str) -> CompiledFunction:
        scripted = self._script(target)
        if scripted is not None:
            return CompiledFunction(self._executable(scripted), "scripted", reason)
        return CompiledFunction(target.fn, "python", reason)

    def _script(self, target: FunctionTarget) -> _AsTuple | None:
        if target.scriptable is None or target.expected is None:
            return None
        with _caught_warnings() as caught:
            try:
                candidate = _AsTuple(torch.jit.script(target.scriptable))
                with torch.no_grad():
                    actual = candidate(*target.example_inputs)
            except Exception:  # not scriptable: fall back to Python
                return None
        reemit(_sort_warnings(caught)[1])
        return candidate if _reproduces(actual, target.expected) else None

    def compile_module(
        self, module: nn.Module, example_inputs: tuple[torch.Tensor, ...], label: str
    ) -> CompiledModule:
        if not torchscript_available():
            raise RunEagerly(UNAVAILABLE)
        with _caught_warnings() as caught:
            try:
                traced = torch.jit.trace(
                    module, example_inputs, check_trace=False, _store_inputs=False
                )
            except RuntimeError as error:
                if _CAPTURED_CONSTANT not in str(error):
                    raise
                raise TraceError(captured_tensor_message(label)) from None
        tracer, other = _sort_warnings(caught)
        reemit(other)
        _refuse_baked_sizes(tracer, traced.inlined_graph, label)
        # .forward skips nn.Module.__call__ (about 5 us); nobody hooks the traced wrapper.
        tensors = [*example_inputs, *module.parameters(), *module.buffers()]
        run = self._executable(traced.forward, traced.inlined_graph, tensors)
        return CompiledModule(run, tuple(tracer), _uses_rng(traced.inlined_graph))


def trace_graph(
    graph: nn.Module, example_inputs: tuple[torch.Tensor, ...], optimize: bool | None = None
) -> Callable[..., Any] | None:
    """A TorchScript trace of a captured FX graph, run by TorchScript's interpreter: one C++
    call per step instead of one Python call per op. The graph has no Python control flow, so
    the trace is faithful. None where TorchScript is unavailable or the trace fails."""
    if not torchscript_available():
        return None
    with _caught_warnings() as caught:
        try:
            traced = torch.jit.trace(graph, example_inputs, check_trace=False, _store_inputs=False)
        except Exception as error:  # an op the tracer cannot record: use another tier
            logger.debug("phi_torch_jit: TorchScript could not trace a captured graph: %s", error)
            return None
    reemit(_sort_warnings(caught)[1])
    engine = TorchScriptEngine(optimize)
    return engine._executable(traced.forward, traced.inlined_graph, example_inputs)  # type: ignore[no-any-return]
