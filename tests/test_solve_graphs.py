"""A PhiML solve captured as one graph around its captured solvers (``engines._solve_graphs``,
``adapters.phiml._solve_ops``): its Python runs at the capture only, its results equal
eager's, also where the matrix is computed from the step's inputs."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("phiml")
pytest.importorskip("phi")

from helpers import phiml_eager
from phi.torch.flow import ZERO_GRADIENT, Box, Noise, Solve, StaggeredGrid, fluid, math, spatial
from phiml.math import _optimize

import phi_torch_jit as ptj
from phi_torch_jit.adapters.phiml._cg import Solvers


def _phiml(test: Any) -> Any:
    """The marks of a test running PhiML's eager code beside ours."""
    for mark in (
        pytest.mark.torchscript_bodies,  # PhiML's eager code calls torch.jit.script
        pytest.mark.filterwarnings("ignore::UserWarning"),  # sparse CSR beta notice
        pytest.mark.filterwarnings("ignore::DeprecationWarning"),
        pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    ):
        test = mark(test)
    return test


def _flow(seed: int) -> Any:
    math.seed(seed)
    return StaggeredGrid(Noise(), ZERO_GRADIENT, x=12, y=12, bounds=Box(x=16, y=16)) * (1 + seed)


def project(v: Any) -> tuple[Any, Any]:
    with math.SolveTape() as tape:
        v, _ = fluid.make_incompressible(v, (), Solve("CG-adaptive", 1e-5, 1e-5))
    return v, tape[0].iterations


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls of PhiML's ``_linear_solve_forward`` (its Python around a solve)."""
    calls: list[int] = []
    original = _optimize._linear_solve_forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(_optimize, "_linear_solve_forward", counted)
    return calls


@_phiml
@pytest.mark.parametrize("graphed", [True, False], ids=["as-ops", "without-as-ops"])
def test_a_phiml_solves_python_runs_only_when_it_is_captured(
    graphed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engine auto (TorchScript-free) on a PhiFlow projection: once compiled, the calls run
    no PhiML Python around the solve, and equal eager's (solution within the solve's
    tolerance, the same iteration counts through the SolveTape). Without ``as_ops`` (a library
    that cannot record its solvers as ops) the Python form serves and runs it every call."""
    if not graphed:
        monkeypatch.delattr(Solvers, "as_ops")
    calls = _counting(monkeypatch)
    jitted = ptj.jit(project, engine="auto", backend="aot_eager", compile_on="caller")
    jitted(_flow(0))
    ptj.wait_compiled()
    calls.clear()
    for seed in (1, 2, 3):
        v = _flow(seed)
        with phiml_eager():
            want_v, want_iterations = project(v)
        calls_before = len(calls)
        got_v, got_iterations = jitted(v)
        assert len(calls) - calls_before == (0 if graphed else 1)
        assert got_iterations.numpy().tolist() == want_iterations.numpy().tolist()
        assert float(math.max(abs(got_v.values - want_v.values))) < 1e-4
    assert jitted.num_traces == 1
    report = jitted.explain()
    assert ("the library's Python around it captured as a graph" in report) == graphed, report


@math.jit_compile_linear(auxiliary_args="k")
def _diffusion(x: Any, k: Any) -> Any:
    return x - k * math.laplace(x)


def implicit(u: Any, k: Any) -> Any:
    return math.solve_linear(_diffusion, u, Solve("CG", 1e-6, 1e-6, x0=u * 0), k=k)


@_phiml
@pytest.mark.usefixtures("no_compile_left_running")
def test_a_matrix_computed_from_the_steps_inputs_is_rebuilt_at_every_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The matrix's parts are inputs of the solve's op, not constants of its graph: a
    diffusivity passed to the step changes the matrix on every call without a retrace."""
    calls = _counting(monkeypatch)
    jitted = ptj.jit(implicit, engine="auto", backend="aot_eager", compile_on="caller")
    math.seed(0)
    u = math.random_normal(spatial(x=16, y=16))
    jitted(u, math.tensor(0.2))
    ptj.wait_compiled()
    calls.clear()
    for k in (0.2, 0.7, 1.5):
        with phiml_eager():
            want = implicit(u, math.tensor(k))
        calls.clear()
        got = jitted(u, math.tensor(k))
        assert not calls  # PhiML's Python around the solve did not run
        assert float(math.max(abs(got - want))) < 1e-4 * float(math.max(abs(want)))
    assert jitted.num_traces == 1
    assert "captured as a graph" in jitted.explain(), jitted.explain()


def test_a_capture_that_would_change_what_phiml_computes_fails() -> None:
    """Seeing a trace, PhiML unrolls its ``while_loop`` to ``max_iter`` and drops
    preconditioners, with a RuntimeWarning: while solves are captured as ops, its
    ``while_loop`` raises and such a warning fails the capture (the Python form serves)."""
    from phiml.backend.torch._torch_backend import TorchBackend

    from phi_torch_jit.adapters.phiml._solve_ops import NotAnOp, solvers_as_ops

    backend = TorchBackend()
    with pytest.raises(NotAnOp, match="while_loop"), solvers_as_ops():
        backend.while_loop(lambda i: (i + 1,), (torch.tensor(0),), 10)
    with pytest.raises(NotAnOp, match="PhiML warned while captured: preconditioner dropped"):
        with solvers_as_ops():
            filename = _optimize.__file__  # as if PhiML's solve warned
            warnings.warn_explicit("preconditioner dropped", RuntimeWarning, filename, 1)
    with solvers_as_ops():  # another library's warning does not
        warnings.warn_explicit("elsewhere", RuntimeWarning, "/site-packages/other/x.py", 1)
    counted = backend.while_loop(lambda go, i: (i < 2, i + 1), (torch.tensor(True), 0), 10)
    assert counted[1] == 3  # outside: PhiML's loop


@_phiml
def test_the_ops_of_a_refused_capture_are_released_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each capture registers its solver calls as ops. Where its graph is refused (here: made
    to differ from the recording), they are released when the capture ends, not kept as long
    as the engine's captured solvers; a kept graph's live as long as the graph."""
    import gc

    from phi_torch_jit.engines import _opaque_calls, _solve_graphs

    gc.collect()
    before = len(_opaque_calls._CALLABLES)
    monkeypatch.setattr(_solve_graphs, "solved_alike", lambda actual, expected: False)
    refused = ptj.jit(project, engine="auto", backend="aot_eager", compile_on="caller")
    refused(_flow(0))
    assert "captured as a graph" not in refused.explain()
    assert len(_opaque_calls._CALLABLES) == before
    monkeypatch.undo()
    kept = ptj.jit(project, engine="auto", backend="aot_eager", compile_on="caller")
    kept(_flow(0))
    assert "captured as a graph" in kept.explain()
    assert len(_opaque_calls._CALLABLES) > before
    del kept, refused
    gc.collect()
    assert len(_opaque_calls._CALLABLES) == before
