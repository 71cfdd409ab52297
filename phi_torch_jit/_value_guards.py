"""Stage 4 (value guards): guard the tensor values that traced Python turned into control flow.

A trace records operations, not Python decisions: ``if x.sum() > 0:``,
``int(n)``, ``t.item()`` are evaluated once and the branch taken is baked in.
torch only warns (TracerWarning); the ancestor even hid the warning. Here,
while the wrapper is traced, the tensor-to-Python conversions
(``__bool__``, ``__int__``, ``__float__``, ``__index__``, ``item``,
``tolist``) are intercepted: each one made by user code is recorded as a
:class:`Conversion` -- the traced tensor, the Python value it gave and the
user's ``file:line``. The wrapper returns those tensors as extra outputs of
the compiled program, and every compiled call converts them the same way and
compares with the recorded values (:class:`ValueGuard`). On a mismatch the
jitted function retraces for the new branch, runs eagerly, or raises,
depending on ``jit(on_guard_failure=...)``.

Conversions made inside torch's private packages and tracing machinery are
not guarded; those torch's public Python makes for the user's call (BatchNorm's
``1 / float(num_batches_tracked)`` with ``momentum=None``) are, placed at the
user's line (:func:`_in_torchs_library`). Functions without conversions pay
nothing. See NOTE [value guards].
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ._compat import (
    PROXY_TENSOR,
    VALUE_OUT_OF_GRAPH,
    TracerWarning,
    disable_dispatch_modes,
    get_tracing_state,
    tensor_conversion,
    value_trace,
)
from ._context import Phase, current_frame
from ._patches import RefCounted
from ._reads._records import same_value
from ._sources import OWN_DIR, TORCH_DIR, user_location
from ._static_shapes import sized_op, static_form
from ._tensor_reads import PASS, watching
from ._value_sized import note_sized, note_sized_node, propagate_sized, stop_watching

__all__ = [
    "Conversion",
    "ValueGuard",
    "SizeLeftDynamic",
    "conversion_capture",
    "value_guards",
    "GUARD_POLICIES",
]

GUARD_POLICIES = ("retrace", "eager", "error", "off")
"""Accepted values of ``jit(on_guard_failure=...)``."""


@dataclass(frozen=True)
class Conversion:
    """A tensor turned into a Python value while the wrapper was traced."""

    tensor: torch.Tensor
    """The traced tensor (becomes an extra output of the compiled program)."""
    kind: str
    """The conversion: ``__bool__``, ``__int__``, ``__float__``, ``__index__``, ``item``..."""
    value: Any
    """What it gave during the trace: the branch that was baked in."""
    location: str
    """The user's ``file:line`` that made it."""
    sized: bool = False
    """A size a static form specialized the graph for (NOTE [value-dependent sizes])."""


@dataclass(frozen=True)
class ValueGuard:
    """Checks, on each compiled call, that a converted value is still what was traced."""

    kind: str
    """The conversion to repeat."""
    expected: Any
    """The value it gave while tracing."""
    location: str
    """The user's ``file:line``."""

    def holds(self, tensor: torch.Tensor) -> bool:
        return same_value(_convert(self.kind, tensor), self.expected)

    def describe(self, tensor: torch.Tensor | None = None) -> str:
        call = {"__bool__": "bool", "__int__": "int", "__float__": "float", "__index__": "index"}
        name = call.get(self.kind, f".{self.kind}")
        now = "" if tensor is None else f" -> {_brief(_convert(self.kind, tensor))}"
        return f"{name}(...) at {self.location}: {_brief(self.expected)}{now}"


class SizeLeftDynamic(ValueGuard):
    """A size the captured graph computes itself, for any values: it always holds (its tensor
    is still among the program's outputs, after the other guards' places)."""

    def holds(self, tensor: torch.Tensor) -> bool:
        return True

    def describe(self, tensor: torch.Tensor | None = None) -> str:
        return f"{super().describe(tensor)} (not checked: the program computes it for any values)"


def value_guards(conversions: list[Any], generic: bool) -> tuple[ValueGuard, ...]:
    """The guards of a trace's conversions; ``generic``: the graph left its sizes dynamic."""
    return tuple(
        (SizeLeftDynamic if generic and c.sized else ValueGuard)(c.kind, c.value, c.location)
        for c in conversions
    )


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _convert(kind: str, tensor: torch.Tensor) -> Any:
    return tensor_conversion(kind)(tensor)


# Nodes through which a traced value can only carry shape information.
_SHAPE_KINDS = frozenset(
    (
        "aten::size prim::Constant prim::NumToTensor aten::Int aten::ScalarImplicit aten::mul "
        "aten::add aten::sub aten::floordiv aten::floor_divide aten::div aten::remainder "
        "aten::neg prim::ListConstruct prim::TupleConstruct prim::TupleUnpack aten::__getitem__ "
        "aten::numel aten::dim aten::len aten::eq aten::ne aten::lt aten::gt aten::le aten::ge "
        "aten::__and__ aten::__or__ aten::__not__ aten::min aten::max"
    ).split()
)


def _from_shapes(tensor: torch.Tensor) -> bool:
    """Whether a traced tensor derives only from tensor sizes (``x.shape[0] * 2``).

    Shapes are part of the cache key, so such a value cannot change between calls of one
    specialization: no guard needed (PhiML converts every size with ``int``).
    """
    if get_tracing_state() is None:  # not TorchScript (graph capture): sizes are ints
        return False
    try:
        value = value_trace(tensor)
    except RuntimeError:  # not a traced value (e.g. a constant)
        return False
    pending, seen = [value.node()], 0
    while pending and seen < 50:
        node = pending.pop()
        seen += 1
        kind = node.kind()
        if kind not in _SHAPE_KINDS:
            return False
        if kind != "aten::size":  # the tensor a size is taken of does not matter
            pending.extend(v.node() for v in node.inputs())
    return not pending


def _guard_read(kind: str, tensor: torch.Tensor, args: tuple[Any, ...], read: Any) -> Any:
    """The :mod:`._tensor_reads` watcher of the trace phase: a read user code makes in a trace
    frame is recorded as a :class:`Conversion`."""
    frame = current_frame()
    if frame is None or frame.phase is not Phase.TRACE or frame.conversions is None:
        return PASS
    # Guarded (user code) or a shape check inside torch: torch's TracerWarning is moot.
    # Graph capture (make_fx on real tensors) refuses conversions; the value is real.
    with warnings.catch_warnings(), disable_dispatch_modes():
        warnings.simplefilter("ignore", TracerWarning)
        value = read(tensor, *args)
    if kind == "numpy":  # a copy: the array shares the tensor's memory
        value = value.copy()
    # who read the tensor (past the patched method; for numpy past torch's Tensor.__array__)
    location = user_location(2, skip_torch=kind == "numpy") or _in_torchs_library(2)
    if location is not None and not _from_shapes(tensor):
        frame.conversions.append(Conversion(tensor, kind, value, location))
    return value


def _in_torchs_library(depth: int) -> str | None:
    """Where a read that torch's Python made is guarded; None where it is not guarded.

    * By torch's public Python for the user's call (``torch.nn``, ``torch.distributions``:
      BatchNorm's ``1 / float(num_batches_tracked)`` with ``momentum=None``): the user's line
      that called into torch, and torch's. Such reads were taken for shape checks and baked,
      though sizes are ints while a graph is captured.
    * Relayed by a torch-function mode (``torch.set_default_device``: its
      ``__torch_function__`` calls every op, conversions included, once more): None, the
      outer read is the one recorded (or not).
    * By torch's public Python when the jitted callable is torch's own module
      (``jit(nn.Sequential(..., nn.BatchNorm1d(8, momentum=None)))``): torch's line.
    * By torch's private packages and tracing machinery (``torch._refs``, ``torch.fx``...), or
      for our own code: None, as before.
    """
    frame: Any = sys._getframe(depth + 1)
    if frame.f_code.co_name == "__torch_function__":
        return None
    here = None
    while frame is not None and frame.f_code.co_filename.startswith((TORCH_DIR, OWN_DIR)):
        name, code = frame.f_code.co_filename, frame.f_code.co_name
        if name == _WRAPPER:  # the jitted callable is torch's own (jit(nn.BatchNorm1d(...)))
            break
        if name.startswith(OWN_DIR):
            if name not in _RELAYS:  # our own code read it (or called torch that did)
                return None
        elif code != "__torch_function__" and here is None:
            if _machinery(name[len(TORCH_DIR) :]):
                return None
            here = f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    user = None
    if frame is not None and frame.f_code.co_filename != _WRAPPER:
        user = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    if here is None:  # only relays: not torch's own read
        return None
    return f"{user} (in {here})" if user else here


_WRAPPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_wrapper.py")
"""The wrapper module that calls the jitted callable in the trace (:mod:`._wrapper`)."""
_RELAYS = frozenset(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), *parts)
    for parts in (("_tensor_reads.py",), ("_compat", "_fx_threads.py"))
)
"""Our patched conversion methods (:mod:`._tensor_reads`) and FX's per-thread class patches
(:mod:`._compat._fx_threads`, a module call in a trace): they relay a read, own none."""

_MACHINERY = frozenset(("fx", "export", "jit", "onnx", "autograd", "testing", "compiler"))
"""torch's packages whose Python belongs to tracing and compiling, not to a user's step."""


def _machinery(relative: str) -> bool:
    parts = relative.split(os.sep)
    return (
        any(p.startswith("_") for p in parts[:-1])
        or relative.startswith("_")
        or (parts[0] in _MACHINERY)
    )


_READS_IN_OPS = ("aten.item.default", "aten._local_scalar_dense.default")
"""What make_fx's dispatch sees when a torch op reads a tensor's value in C++ (an argument
that must be a number: ``torch.add(x, y, alpha=t)``, ``torch.ones(n)``, ``x.repeat(n)``)."""


def _guarding_reads_in_ops(original: Callable[..., Any]) -> Callable[..., Any]:
    """make_fx's ``proxy_call`` that turns a value read inside an op into a guarded conversion.

    A graph capture refuses such a read (the graph would bake it); TorchScript traces some of
    them and value-guards the rest. Here a read made for user code (its ``file:line`` is the
    user's) is a :class:`Conversion` like ``t.item()`` in Python: the value is baked, and the
    tensor becomes an extra output checked on every call (NOTE [value guards]). A read for
    torch's or our own code, or outside a trace frame, is refused as before."""

    def proxy_call(mode: Any, func: Any, pre_dispatch: bool, args: Any, kwargs: Any) -> Any:
        frame = current_frame()
        if frame is not None and frame.phase is Phase.TRACE and frame.conversions is not None:
            tracing = frame

            def trace(op: Any, op_args: tuple[Any, ...], op_kwargs: dict[str, Any]) -> Any:
                out = proxy_call(mode, op, pre_dispatch, op_args, op_kwargs)
                if sized_op(op, op_kwargs):  # the node a generic graph puts back in its form
                    note_sized_node(tracing, next(iter(reversed(mode.tracer.graph.nodes))))
                return out

            form = static_form(func, args, kwargs, trace)
            if form is not None:  # NOTE [value-dependent sizes]
                result, sizes = form
                where = user_location(1, skip_torch=True) or f"{func} in torch"
                frame.conversions.extend(
                    Conversion(s.tensor, "__int__", s.value, f"{where} ({s.what})", sized=True)
                    for s in sizes
                )
                note_sized(frame, result)
                return result
        try:
            out = original(mode, func, pre_dispatch, args, kwargs)
        except RuntimeError as error:
            if str(func) not in _READS_IN_OPS or VALUE_OUT_OF_GRAPH not in str(error):
                raise
            frame = current_frame()
            if frame is None or frame.phase is not Phase.TRACE or frame.conversions is None:
                raise
            location = user_location(1, skip_torch=True)
            if location is None:
                raise
            with disable_dispatch_modes():
                value = tensor_conversion("item")(args[0])
            frame.conversions.append(Conversion(args[0], "item", value, location))
            return value
        if frame is not None and frame.sized.tensors:
            propagate_sized(frame, func, args, kwargs, out)
        return out

    proxy_call.__wrapped__ = original  # type: ignore[attr-defined]
    return proxy_call


def _guarded_equal(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.equal`` / ``Tensor.equal`` in traced user code: a Python bool computed from
    values, which TorchScript's trace baked silently (no TracerWarning) and a graph capture
    refused. Guarded as ``bool((x == y).all())`` (tensors of different shapes are never
    equal, and shapes are part of the cache key)."""

    def equal(x: Any, y: Any) -> bool:
        frame = current_frame()
        if frame is None or frame.phase is not Phase.TRACE or frame.conversions is None:
            return bool(original(x, y))
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape != y.shape:
            return False  # never equal; shapes are part of the cache key
        location = user_location(1)
        if location is None or not isinstance(y, torch.Tensor):
            return bool(original(x, y))
        tensor = torch.eq(x, y).all()
        with warnings.catch_warnings(), disable_dispatch_modes():
            warnings.simplefilter("ignore", TracerWarning)
            value = bool(tensor_conversion("__bool__")(tensor))
        frame.conversions.append(Conversion(tensor, "__bool__", value, location))
        return value

    equal.__wrapped__ = original  # type: ignore[attr-defined]
    return equal


def _install() -> None:
    torch.Tensor.equal = _guarded_equal(torch.Tensor.equal)  # type: ignore[method-assign]
    torch.equal = _guarded_equal(torch.equal)
    proxy_tensor = PROXY_TENSOR.find()
    proxy_tensor.proxy_call = _guarding_reads_in_ops(proxy_tensor.proxy_call)


def _remove() -> None:
    del torch.Tensor.equal
    torch.equal = torch.equal.__wrapped__  # type: ignore[attr-defined]
    proxy_tensor = PROXY_TENSOR.find()
    proxy_tensor.proxy_call = proxy_tensor.proxy_call.__wrapped__


_CAPTURE = RefCounted(_install, _remove)


@contextmanager
def conversion_capture(frame: Any) -> Iterator[None]:
    """Record user conversions made in trace frames while the block runs (``frame``'s)."""
    with watching(_guard_read), _CAPTURE.active():
        try:
            yield
        finally:
            stop_watching(frame)
