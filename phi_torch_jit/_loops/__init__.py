"""Loop capture: a data-dependent Python loop in a custom function becomes blocks of
predicated iterations, traced and compiled once per input signature.

The stages: :mod:`._analysis` finds the loops and what they carry, :mod:`._rewrite` builds the
function again with each loop replaced by a call of its runtime, :mod:`._block` traces and
compiles blocks and runs the host loop. No TorchScript. What is captured, what is not and why:
docs/loops.md. Engines call :func:`capture_loops`; the engine checks the result against the
record pass's outputs before it serves it.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ._analysis import plan_function
from ._block import BLOCK_CPU, BLOCK_CUDA, HELPERS, CapturedLoop, CaptureFailed
from ._rewrite import rewrite

__all__ = ["Captured", "capture_loops", "CapturedLoop", "CaptureFailed", "BLOCK_CPU", "BLOCK_CUDA"]

_AST_LOCK = threading.Lock()

CompileGraph = Callable[[torch.fx.GraphModule, tuple[torch.Tensor, ...]], Any]


@dataclass(frozen=True)
class Captured:
    """A function whose loops run as compiled blocks."""

    function: types.FunctionType
    """Same arguments and results as the user's function."""
    loops: tuple[CapturedLoop, ...]
    refused: tuple[str, ...]
    """Loops left as Python, each with its line and why."""

    def describe(self) -> str:
        lines = ", ".join(f"line {loop.line}" for loop in self.loops)
        text = f"loop at {lines} captured as blocks of predicated iterations"
        if self.refused:
            text += f" (not captured: {'; '.join(self.refused)})"
        return text


def capture_loops(
    fn: Any,
    label: str,
    compile_graph: CompileGraph | None,
    block: int | None = None,
    lock: Any = None,
) -> Captured | str:
    """``fn`` with its capturable loops replaced, or why none is (a sentence). ``lock``: taken
    (without waiting) around each block's trace and compile: the engine's tracing lock."""
    if not isinstance(fn, types.FunctionType):
        return "it is not a Python function"
    runtimes: list[CapturedLoop] = []
    # CPython 3.11 converts AST objects with a per-interpreter recursion counter: two threads
    # parsing or compiling ASTs at once raise "SystemError: AST constructor recursion depth
    # mismatch" (found by two threads jitting at once).
    with _AST_LOCK:
        plan = plan_function(fn)
        if isinstance(plan, str):
            return plan
        if not plan.loops:
            return "; ".join(plan.refused) if plan.refused else "it has no loop at its top level"
        rewritten = rewrite(fn, plan, runtimes, HELPERS)
    for loop, (iterate, enter) in zip(plan.loops, rewritten.iterations):
        runtime = CapturedLoop(
            f"{label} (line {loop.line})",
            loop.line,
            iterate,
            enter,
            tuple(name in loop.in_place for name in loop.carried),
            tuple(name in loop.mixed for name in loop.carried),
            compile_graph,
            block,
            lock,
        )
        runtimes.append(runtime)
    return Captured(rewritten.function, tuple(runtimes), plan.refused)
