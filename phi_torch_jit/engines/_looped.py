"""Engines "compile" and "auto": custom-function bodies whose loops run as compiled blocks.

A body that TorchScript cannot trace faithfully (its loop exits on tensor values) goes to
loop capture (``phi_torch_jit._loops``, docs/loops.md): each capturable loop runs as blocks of
predicated iterations compiled by the engine's backend. The captured function is run once on
the recorded inputs and must reproduce the recorded outputs; otherwise, or when no loop can be
captured, the body keeps what the ``functions`` engine made of it, and the reason is logged.

PhiML's custom functions (its solves' forward and backward) reach their loops through PhiML's
backend, where loop capture does not follow calls: they run with PhiML's CG solvers captured
instead (:mod:`phi_torch_jit._loops._phiml_cg`), checked the same way, and only if a captured
solver ran in the check.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from .._loops import Captured, capture_loops
from .._loops._phiml_cg import Solvers
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
    solvers = None
    if isinstance(captured, str) and is_phiml(source):
        solvers = phiml_solvers(compile_graph, lock)
        captured = Captured(solvers.calling(source), (), ())
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
        _not_captured(target, "it ran none of PhiML's CG solvers")
        return None
    if not _reproduces(actual[: len(expected)], expected):  # then a PhiML solve's checks
        _not_captured(target, "the captured loop did not reproduce the recorded outputs")
        return None
    loops = solvers.loops() if solvers is not None else captured.loops
    eager = sorted(reason for loop in loops for reason in loop.eager_reasons)
    if eager:  # its iterations would run eagerly, with copies and merges: slower than Python
        _not_captured(target, f"a block cannot be traced for the recorded inputs: {eager[0]}")
        return None
    description = solvers.describe() if solvers is not None else captured.describe()
    return CompiledFunction(run, "looped", description)


TIMED_RUNS = 3
"""Runs of each program timed by :func:`faster` (after one untimed run each)."""


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
                start = time.perf_counter()
                program.run(*target.example_inputs)
                best[n] = min(best[n], time.perf_counter() - start)
    chosen = min(range(len(programs)), key=best.__getitem__)
    logger.info(
        "phi_torch_jit: %s: %s serves (%s)",
        target.label,
        programs[chosen].mode,
        ", ".join(f"{p.mode} {1e3 * t:.2f} ms" for p, t in zip(programs, best)),
    )
    return programs[chosen]


def is_phiml(source: Any) -> bool:
    """Whether ``source`` is PhiML's code (its custom functions' forward or backward)."""
    module = getattr(source, "__module__", None) or ""
    return module == "phiml" or module.startswith("phiml.")


_UNCOMPILED: dict[Any, Solvers] = {}
"""PhiML's solvers whose blocks run as traced, uncompiled graphs (``compile_graph`` None)."""


def phiml_solvers(compile_graph: Any, lock: Any) -> Solvers:
    """The captured PhiML solvers whose blocks ``compile_graph`` (an engine's method) compiles:
    made once per engine, kept on it (forgotten with it), shared by all its solves."""
    owner = getattr(compile_graph, "__self__", None)
    solvers = _UNCOMPILED.get(lock) if owner is None else getattr(owner, _ATTRIBUTE, None)
    if solvers is None:

        def capture(fn: Any, label: str) -> Captured | str:
            return capture_loops(fn, label, compile_graph, lock=lock)

        solvers = Solvers(capture)
        if owner is None:
            _UNCOMPILED[lock] = solvers
        else:
            setattr(owner, _ATTRIBUTE, solvers)
    return solvers


_ATTRIBUTE = "_phi_torch_jit_phiml_solvers"


def _not_captured(target: FunctionTarget, reason: str) -> None:
    logger.info("phi_torch_jit: %s: loops not captured: %s", target.label, reason)
