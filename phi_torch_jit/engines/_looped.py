"""Engines "compile" and "auto": custom-function bodies whose loops run as compiled blocks.

A body that TorchScript cannot trace faithfully (its loop exits on tensor values) goes to
loop capture (``phi_torch_jit._loops``, docs/loops.md): each capturable loop runs as blocks of
predicated iterations compiled by the engine's backend. The captured function is run once on
the recorded inputs and must reproduce the recorded outputs; otherwise, or when no loop can be
captured, the body keeps what the ``functions`` engine made of it, and the reason is logged.

A registered library's custom functions (PhiML's solves' forward and backward) reach their loops
through the library's code, where loop capture does not follow calls: they run with the
library's solvers captured instead (:meth:`phi_torch_jit.extend.Library.loop_solvers`; PhiML's
CG solvers, ``adapters.phiml``), checked the same way, and only if a captured solver ran in the
check.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable
from typing import Any, cast

import torch

from .._libraries import library_solvers
from .._loops import Captured, capture_loops
from ..extend import LoopSolvers
from ._solve_graphs import around_solvers, solved_alike
from .base import CompiledFunction, FunctionTarget
from .torchscript import _AsTuple, _reproduces

__all__ = ["with_captured_loops"]

logger = logging.getLogger("phi_torch_jit")


def with_captured_loops(
    target: FunctionTarget,
    compile_graph: Callable[[torch.fx.GraphModule, tuple[torch.Tensor, ...]], Any] | None,
    lock: Any,
) -> CompiledFunction | None:
    """The body with its loops captured, checked against the recording; None if it cannot be
    (logged at INFO with the reason)."""
    if target.expected is None and target.reference is None:
        return None
    if target.loop_source is not None and target.with_loop_source is not None:
        source, wrap = target.loop_source, target.with_loop_source
    elif target.scriptable is not None:
        source, wrap = target.scriptable, _AsTuple
    else:
        return None
    captured: Captured | str = capture_loops(source, target.label, compile_graph, lock=lock)
    solvers = solvers_of(source, compile_graph, lock) if isinstance(captured, str) else None
    if solvers is not None:
        captured = Captured(cast(types.FunctionType, solvers.calling(source)), (), ())
    if isinstance(captured, str):
        _not_captured(target, captured)
        return None
    run = wrap(captured.function)
    runs = solvers.runs if solvers is not None else 0
    expected = target.expected
    try:
        if expected is None:
            assert target.reference is not None
            with torch.no_grad():
                expected = target.reference()
    except Exception as error:  # the Python function itself fails on these inputs
        _not_captured(target, f"{type(error).__name__}: {error}".splitlines()[0])
        return None
    try:
        with torch.no_grad():
            actual = run(*target.example_inputs)
    except Exception as error:  # the captured function cannot run these inputs
        _not_captured(target, f"{type(error).__name__}: {error}".splitlines()[0])
        return None
    if solvers is not None and solvers.runs == runs:
        _not_captured(target, "it ran none of the library's captured solvers")
        return None
    same = _reproduces if solvers is None else solved_alike  # then a library's deferred checks
    if not same(actual[: len(expected)], expected):
        _not_captured(target, "the captured loop did not reproduce the recorded outputs")
        return None
    loops = solvers.loops() if solvers is not None else captured.loops
    eager = sorted(reason for loop in loops for reason in loop.eager_reasons)
    if eager:  # its iterations would run eagerly, with copies and merges: slower than Python
        _not_captured(target, f"a block cannot be traced for the recorded inputs: {eager[0]}")
        return None
    description = solvers.describe() if solvers is not None else captured.describe()
    if solvers is not None:
        graphed = around_solvers(target, run, solvers, expected, lock)
        if graphed is not None:
            return graphed
    if solvers is None and _compiled_later(captured.loops):
        run = _PythonUntilCompiled(run, wrap(source), captured.loops)
        description += "; the Python loop while the blocks are not compiled"
    return CompiledFunction(run, "looped", description)


def _compiled_later(loops: Any) -> bool:
    """Whether blocks of these loops run straight-line until a background compile replaces
    them (engine auto, ``engines._block_tiers``)."""
    return any(hasattr(p, "straight_line") for loop in loops for p in loop.programs.values())


class _PythonUntilCompiled:
    """The function as written (its loops as Python, eager speed) while a block of its
    captured loops still runs straight-line, then the captured loops: straight-line blocks
    carry predicated iterations and run a whole block past convergence: bench-peers (c)'s
    training step, its compile held back, took 50 ms with them, 38-41 ms with the Python loop,
    eager 26-27 ms.
    The captured function reproduced the recorded outputs, so both compute the same. A block
    whose compile failed stays straight-line, and the Python loop serves for good."""

    def __init__(self, looped: Any, python: Any, loops: Any) -> None:
        self.looped, self.python, self.loops = looped, python, loops
        self.compiled = False

    def __call__(self, *args: Any) -> Any:
        if not self.compiled:
            if any(loop.runs_straight_line() for loop in self.loops):
                return self.python(*args)
            self.compiled = True
        return self.looped(*args)


TIMED_RUNS = 3
"""Runs of each program timed by :func:`faster` (after one untimed run each)."""
CLOCK: Callable[[], float] = time.perf_counter
"""Seconds, read by :func:`faster`; replaced by tests."""


def faster(target: FunctionTarget, *programs: CompiledFunction) -> CompiledFunction:
    """The program that runs ``target``'s recorded inputs fastest: the best of
    ``TIMED_RUNS`` runs each, alternating, after one untimed run each (a TorchScript
    program optimizes itself in its first runs). Logged at INFO."""
    best = [float("inf")] * len(programs)
    with torch.no_grad():
        for program in programs:
            program.run(*target.example_inputs)
        for _ in range(TIMED_RUNS):
            for n, program in enumerate(programs):
                start = CLOCK()
                program.run(*target.example_inputs)
                best[n] = min(best[n], CLOCK() - start)
    chosen = min(range(len(programs)), key=best.__getitem__)
    logger.info(
        "phi_torch_jit: %s: %s serves (%s)",
        target.label,
        programs[chosen].mode,
        ", ".join(f"{p.mode} {1e3 * t:.2f} ms" for p, t in zip(programs, best)),
    )
    return programs[chosen]


def _capture(compile_graph: Any, lock: Any) -> Callable[[Any, str], Captured | str]:
    def capture(fn: Any, label: str) -> Captured | str:
        return capture_loops(fn, label, compile_graph, lock=lock)

    return capture


_UNCOMPILED: dict[Any, dict[Any, LoopSolvers | None]] = {}
"""Libraries' solvers whose blocks run as traced, uncompiled graphs (``compile_graph`` None),
by lock."""


def _solver_cache(compile_graph: Any, lock: Any) -> dict[Any, LoopSolvers | None]:
    """Where the libraries' captured solvers whose blocks ``compile_graph`` (an engine's
    method) compiles are kept: on the engine (forgotten with it), shared by all its solves."""
    owner = getattr(compile_graph, "__self__", None)
    if owner is None:
        return _UNCOMPILED.setdefault(lock, {})
    cache: dict[Any, LoopSolvers | None] | None = getattr(owner, _ATTRIBUTE, None)
    if cache is None:
        cache = {}
        setattr(owner, _ATTRIBUTE, cache)
    return cache


def solvers_of(source: Any, compile_graph: Any, lock: Any) -> LoopSolvers | None:
    """The captured solvers of the library owning ``source`` (None: no library's code)."""
    return library_solvers(
        source, _capture(compile_graph, lock), _solver_cache(compile_graph, lock)
    )


_ATTRIBUTE = "_phi_torch_jit_library_solvers"


def _not_captured(target: FunctionTarget, reason: str) -> None:
    logger.info("phi_torch_jit: %s: loops not captured: %s", target.label, reason)
