"""Custom-function bodies captured as FX graphs and run straight-line: no TorchScript.

Engines "compile" and "auto" compile the forward and backward of each custom function with a
``functions`` engine. TorchScript's was the only one that compiled a body; without TorchScript
a body ran as Python. :class:`GraphBodies` captures the body with ``make_fx`` on the recorded
inputs (real tensors, ATen level: bodies run below autograd) and runs the graph as
straight-line Python calling each op's C function (:mod:`._light`), the form engine "auto"'s
fast tier serves.

A capture is faithful only if the body's Python took no decision on tensor values. make_fx
refuses the reads that go through an op (``bool(t)``, ``float(t)``, ``.item()``, ``x[:int(t)]``,
``torch.equal``); ``.tolist()``, ``.numpy()`` and ``np.asarray(t)`` read memory directly, so
they are made to refuse while the body is captured. A graph whose output shapes depend on
values (``nonzero``, a boolean mask) is refused too. Whatever is refused runs as Python, its
loops captured where they can be (:mod:`._looped`), with the reason in ``explain()``. A
captured body must reproduce the recorded outputs on the recorded inputs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .._compat import CURRENT_DISPATCH_MODE, TORCHSCRIPT_NOTICE
from .._fast_capture import fast_metadata
from .._tensor_reads import PASS, watching
from ..errors import NotNow
from ._light import straight_line
from .base import CompiledFunction, CompiledModule, Engine, FunctionTarget
from .torchscript import _reproduces

__all__ = ["GraphBodies", "capture_body", "data_dependent_shape"]

_DIRECT_READS = ("tolist", "numpy")
"""Tensor reads that read memory without an op make_fx could refuse (``np.asarray(t)`` calls
``numpy``)."""


_DATA_DEPENDENT = frozenset(("nonzero", "nonzero_numpy", "argwhere", "_unique", "_unique2",
                             "unique_dim", "unique_consecutive", "_unique_consecutive",
                             "masked_select", "bincount", "histc_dynamic"))  # fmt: skip
"""Ops whose output shape depends on tensor values (``nonzero_static`` is not one of them)."""


def data_dependent_shape(graph: torch.fx.GraphModule) -> str:
    """The first op of ``graph`` whose output shape depends on tensor values (``x.nonzero()``,
    ``torch.unique``, ``x[mask]``), or "" if there is none."""
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        packet, _, overload = name.removeprefix("aten.").rpartition(".")
        masked = name == "aten.index.Tensor" and any(
            getattr(getattr(i, "meta", {}).get("val"), "dtype", None) in (torch.bool, torch.uint8)
            for i in node.args[1]
            if i is not None
        )
        repeats = packet == "repeat_interleave" and overload in ("Tensor", "self_Tensor")
        unsized = (
            repeats
            and node.kwargs.get("output_size") is None
            and (overload == "Tensor" or len(node.args) < 4 or node.args[3] is None)
        )
        where = name == "aten.where.default"  # torch.where(condition): nonzero's columns
        if masked or unsized or where or (name.startswith("aten.") and packet in _DATA_DEPENDENT):
            return name
    return ""


class _NotFaithful(Exception):
    """The body read a tensor's values in Python while it was captured."""


class _Local(threading.local):
    depth: int = 0
    """Captures of bodies running on this thread (a nested custom call's body is compiled
    while its caller's is captured)."""


_LOCAL = _Local()
_OWN_LOCK = threading.Lock()
"""The tracing lock of a GraphBodies made without one."""


def _refuse_direct_reads(kind: str, tensor: torch.Tensor, args: tuple[Any, ...], read: Any) -> Any:
    """The :mod:`.._tensor_reads` watcher of body captures: a direct read on this thread under
    make_fx's dispatch mode raises (a nested call's eager run reads values freely)."""
    if kind in _DIRECT_READS and _LOCAL.depth and CURRENT_DISPATCH_MODE.find()() is not None:
        raise _NotFaithful(f"its Python reads tensor values (Tensor.{kind})")
    return PASS


@contextmanager
def _direct_reads_refused() -> Iterator[None]:
    """Tensor.tolist/numpy (np.asarray) raise on this thread while the block runs and make_fx
    traces."""
    with watching(_refuse_direct_reads):
        _LOCAL.depth += 1
        try:
            yield
        finally:
            _LOCAL.depth -= 1


def capture_body(
    fn: Callable[..., Any],
    inputs: tuple[torch.Tensor, ...],
    prepare: Callable[[torch.fx.GraphModule], Any] | None = None,
) -> Any:
    """``fn`` as a straight-line program of its ATen ops, or a string saying why it cannot be;
    ``prepare`` changes the captured graph in place first (``_folded_reads``)."""
    import warnings

    from torch.fx.experimental.proxy_tensor import make_fx

    def flat(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = fn(*tensors)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    try:
        with _direct_reads_refused(), torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", TORCHSCRIPT_NOTICE, Warning)
            with fast_metadata():
                graph = make_fx(flat, tracing_mode="real")(*inputs)
    except _NotFaithful as refused:
        return str(refused)
    except Exception as error:  # a read make_fx refuses, or anything it cannot follow
        first = str(error).splitlines()[0] if str(error) else ""
        return f"capture failed: {type(error).__name__}: {first[:160]}"
    dependent = data_dependent_shape(graph)
    if dependent:
        return f"the output shape of {dependent} depends on tensor values"
    if prepare is not None:
        prepare(graph)
    try:
        return straight_line(graph)
    except NotImplementedError as error:
        return str(error)


class GraphBodies(Engine):
    """Compiles custom-function bodies as captured graphs run straight-line (no TorchScript);
    bodies that cannot be captured faithfully run as Python. Used as the ``functions``
    engine of engines "compile" and "auto" where TorchScript is not used."""

    name = "graph-bodies"

    def __init__(
        self, lock: Any = None, prepare: Callable[[torch.fx.GraphModule], Any] | None = None
    ) -> None:
        self.prepare = prepare
        """Changes each captured graph in place before it is made straight-line, or None."""
        self.lock = lock if lock is not None else _OWN_LOCK
        """The engine's tracing lock: make_fx keeps process-wide state (torch 2.13's FX
        tracing flag), so no capture may overlap engine "auto"'s background compile. Taken
        around the outermost capture on a thread (a nested custom call's body is captured
        inside its caller's). A forward's capture (the first call of a specialization, which
        engine "auto" only starts while no compile runs) waits for it; a backward's, compiled at
        the first backward, does not: ``NotNow`` makes that backward run as Python, and the
        next one compiles again."""

    def compile_function(self, target: FunctionTarget) -> CompiledFunction:
        if _LOCAL.depth:  # inside this thread's capture of the calling body: lock held
            captured = capture_body(target.fn, target.example_inputs, self.prepare)
        elif target.expected is None and not self.lock.acquire(blocking=False):
            raise NotNow(f"{target.label}: the tracing lock is taken (a background compile)")
        else:
            if target.expected is not None:
                self.lock.acquire()
            try:
                captured = capture_body(target.fn, target.example_inputs, self.prepare)
            finally:
                self.lock.release()
        if isinstance(captured, str):
            return CompiledFunction(target.fn, "python", captured)
        if target.expected is not None:
            with torch.no_grad():
                actual = captured(*target.example_inputs)
            if not _reproduces(tuple(actual), target.expected):
                reason = "its captured graph did not reproduce the recorded outputs"
                return CompiledFunction(target.fn, "python", reason)
        return CompiledFunction(captured, "traced")

    def compile_module(
        self, module: nn.Module, example_inputs: tuple[torch.Tensor, ...], label: str
    ) -> CompiledModule:
        raise NotImplementedError("GraphBodies compiles custom-function bodies only")
