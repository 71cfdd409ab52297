"""Loop capture: a data-dependent Python loop in a custom function becomes blocks of
predicated iterations, traced and compiled once per input signature.

The stages: :mod:`._analysis` finds the loops and what they carry, :mod:`._callees` the
functions called by name whose loops are captured as well, :mod:`._rewrite` builds the
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
from ._callees import MAX_DEPTH, Callee, called_functions
from ._prologue import CapturedPrologue, python_prologue, with_prologues
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
    """Its own loops, then those of the functions it calls."""
    refused: tuple[str, ...]
    """Loops left as Python, each with its line and why."""
    prologues: tuple[CapturedPrologue, ...] = ()
    """The statements before its loops that run as graphs (``_prologue``), then those of the
    functions it calls."""

    def describe(self) -> str:
        lines = ", ".join(f"{loop.owner} line {loop.line}" for loop in self.loops)
        text = f"loop at {lines} captured as blocks of predicated iterations"
        if self.prologues:
            text += ", the statements before it as a graph"
        if self.refused:
            text += f" (not captured: {'; '.join(self.refused)})"
        return text


def capture_loops(
    fn: Any,
    label: str,
    compile_graph: CompileGraph | None,
    block: int | None = None,
    lock: Any = None,
    depth: int = 0,
) -> Captured | str:
    """``fn`` with its capturable loops replaced, or why none is (a sentence). The functions it
    calls by name are captured too, down to ``MAX_DEPTH`` calls (:mod:`._callees`). ``lock``:
    taken (without waiting) around each block's trace and compile: the engine's tracing lock."""
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
        called = called_functions(fn, plan.tree) if depth < MAX_DEPTH else []
    callees: dict[str, Callee] = {}
    inner: list[CapturedLoop] = []
    before: list[CapturedPrologue] = []
    refused = list(plan.refused)
    for call in called:
        captured = capture_loops(
            call.function, f"{label} > {call.name}", compile_graph, block, lock, depth + 1
        )
        if isinstance(captured, Captured):
            callees[call.name] = Callee(call, captured.function)
            inner.extend(captured.loops)
            before.extend(captured.prologues)
            refused.extend(f"in {call.name}, {why}" for why in captured.refused)
        elif captured.startswith("line "):  # it has loops, none capturable: say why
            refused.append(f"in {call.name}, {captured}")
    if not plan.loops and not callees:
        return "; ".join(refused) if refused else "it has no loop at its top level"
    with _AST_LOCK:
        plan, planned = with_prologues(fn, plan, set(callees))
        prologues = {
            name: CapturedPrologue(
                f"{label} (line {p.line})", python_prologue(fn, p), compile_graph, lock
            )
            for name, p in planned.items()
        }
        rewritten = rewrite(fn, plan, runtimes, HELPERS, callees, prologues)
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
            owner=fn.__name__,
        )
        runtimes.append(runtime)
    return Captured(
        rewritten.function, (*runtimes, *inner), tuple(refused), (*prologues.values(), *before)
    )
