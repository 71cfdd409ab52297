"""A library's solve around its captured solvers: checked to the solve's tolerance, and
captured as one graph.

:mod:`._looped` serves a registered library's custom function (PhiML's solve, its forward or
its adjoint in the backward) as the library's Python around its captured solvers. That Python
ran on every call: on a Karman vortex street's pressure solve, about 80% of the solve's time
went to PhiML's trees, shapes and messages around a compiled CG. Where the library can record
each call of its captured solvers as one op (:meth:`phi_torch_jit.extend.LoopSolvers.as_ops`),
:func:`around_solvers` captures that Python form once more with ``make_fx``: the graph holds the
library's tensor ops and one opaque op per solver call (:mod:`._opaque_calls`), and runs
straight-line, the library's Python only at the capture. Both forms are checked against the
recording with :func:`solved_alike`; a capture that fails or differs keeps the Python form
(logged at INFO).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from ..errors import NotNow
from ._folded_reads import fold_read_arguments
from ._graph_bodies import GraphBodies
from ._opaque_calls import collected, keep
from .base import CompiledFunction, FunctionTarget

__all__ = ["around_solvers", "solved_alike", "SOLVE_RTOL"]

logger = logging.getLogger("phi_torch_jit")

SOLVE_RTOL = 1e-3
"""How far a captured library solve's floating outputs may be from the recording's, relative
to each output's largest value (NOTE [captured solves reproduce to the solve's tolerance])."""


def solved_alike(actual: tuple[Any, ...], expected: tuple[Any, ...]) -> bool:
    """Whether a captured library solve reproduced the recorded one: the same shapes and
    dtypes, integer and boolean outputs (iteration counts, converged and diverged flags)
    equal, floating outputs within :data:`SOLVE_RTOL` of their largest value. A CG stops at
    a residual tolerance (PhiML's default 1e-5, relative), and the captured solver sums each
    row of the matrix in another order (padded rows, ``adapters.phiml._cg``): its solution
    differs from the recorded one by rounding that the iterations amplify up to that
    tolerance times the matrix's condition (a pipe flow's pressure: 8.7e-5 of the largest
    value, iterations equal), more than float rounding allows. A capture that computed
    something else differs by far more, or in its counts."""
    if len(actual) != len(expected):
        return False
    for a, e in zip(actual, expected):
        if not isinstance(a, torch.Tensor) or a.shape != e.shape or a.dtype != e.dtype:
            return False
        if not e.is_floating_point():
            if not torch.equal(a, e):
                return False
            continue
        scale = float(e.detach().abs().max()) if e.numel() else 0.0
        if not torch.allclose(a, e, rtol=0.0, atol=SOLVE_RTOL * scale, equal_nan=True):
            return False
    return True


def around_solvers(
    target: FunctionTarget,
    run: Any,
    solvers: Any,
    expected: tuple[torch.Tensor, ...],
    lock: Any,
) -> CompiledFunction | None:
    """``run`` (``target``'s function as the library's Python around its captured solvers,
    which reproduced ``expected``) captured as a graph, each solver call one op; None where the
    library cannot record its solvers as ops, the capture fails or its graph differs. Never
    waits for the tracing ``lock``: while a background compile holds it, the Python form
    serves."""
    as_ops = getattr(solvers, "as_ops", None)
    if as_ops is None:
        return None

    def body(*tensors: torch.Tensor) -> Any:
        with as_ops():
            return run(*tensors)

    with collected() as keys:  # the solver calls' ops: the graph's, if kept
        graphed = _graphed(target, body, lock, expected)
        if graphed is None:
            return None
        keep(keys, graphed)
    description = f"{solvers.describe()}; the library's Python around it captured as a graph"
    return CompiledFunction(graphed, "traced", description, origin=run)


def _graphed(
    target: FunctionTarget, body: Any, lock: Any, expected: tuple[torch.Tensor, ...]
) -> Any:
    """``body`` captured straight-line and checked against ``expected``, or None (logged)."""
    bodies = GraphBodies(lock, prepare=fold_read_arguments)  # a matrix's parts: once
    try:  # no expected outputs: GraphBodies neither waits nor checks; checked here
        graphed = bodies.compile_function(
            dataclasses.replace(target, fn=body, expected=None, reference=None)
        )
    except NotNow:
        return None
    if graphed.mode != "traced":
        _kept(target, graphed.reason)
        return None
    try:
        with torch.no_grad():
            actual = tuple(graphed.run(*target.example_inputs))
    except Exception as error:  # the graph cannot run these inputs
        _kept(target, f"{type(error).__name__}: {error}".splitlines()[0])
        return None
    if not solved_alike(actual[: len(expected)], expected):
        _kept(target, "its graph did not reproduce the recorded outputs")
        return None
    return graphed.run


def _kept(target: FunctionTarget, reason: str) -> None:
    logger.info(
        "phi_torch_jit: %s: the library's Python around its captured solvers stays: %s",
        target.label,
        reason,
    )
