"""PhiML's CG solvers with their loops captured (``phi_torch_jit.adapters.phiml._cg``,
docs/loops.md): the padded-row product equals the sparse one; the captured solvers return
what PhiML's own return (solution, residual, iteration and evaluation counts, convergence
flags) on solves that converge, start at rest, hit ``max_iter`` or meet NaN, running blocks;
PhiML's functions are unchanged outside a compiled solve; a jitted PhiFlow step whose solve is
served captured equals eager, with its SolveTape, its solver errors and its gradients."""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("phiml")
pytest.importorskip("phi")

from helpers import phiml_eager, seeded
from phi.torch.flow import ZERO_GRADIENT, Box, Noise, Solve, StaggeredGrid, field, fluid, math
from phiml.backend.torch import _torch_backend as phiml_torch

import phi_torch_jit as ptj
from phi_torch_jit.adapters.phiml._cg import SOLVERS, padded_rows
from phi_torch_jit.engines import _looped, _solve_graphs
from phi_torch_jit.engines import compile as compile_engine
from phi_torch_jit.engines.base import CompiledFunction, FunctionTarget

pytestmark = [
    pytest.mark.torchscript_bodies,  # PhiML's eager code calls torch.jit.script
    pytest.mark.filterwarnings("ignore::UserWarning"),  # sparse CSR beta notice
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning"),
]


def _original(name: str) -> Any:
    current = getattr(phiml_torch, name)
    return getattr(current, "original", current)  # PhiML's function, dispatcher or not


def _laplacian(n: int, empty_row: bool = False) -> torch.Tensor:
    """A 2D 5-point Laplacian plus a small diagonal (SPD), n*n rows, CSR, float64."""
    size = n * n
    index = torch.arange(size).reshape(n, n)
    rows, cols, vals = [index.flatten()], [index.flatten()], [torch.full((size,), 4.01)]
    for shift, dim in ((1, 0), (-1, 0), (1, 1), (-1, 1)):
        neighbour = torch.roll(index, shift, dim)
        rows.append(index.flatten())
        cols.append(neighbour.flatten())
        vals.append(torch.full((size,), -1.0))
    coo = torch.sparse_coo_tensor(
        torch.stack([torch.cat(rows), torch.cat(cols)]), torch.cat(vals), (size, size)
    ).coalesce()
    if empty_row:  # a row without nonzeros
        keep = coo.indices()[0] != 3
        coo = torch.sparse_coo_tensor(coo.indices()[:, keep], coo.values()[keep], coo.shape)
    return coo.to(torch.float64).coalesce().to_sparse_csr()


def test_the_padded_row_product_equals_the_sparse_product() -> None:
    from phi_torch_jit.adapters.phiml._cg import _product

    for matrix in (_laplacian(6), _laplacian(5, empty_row=True)):
        b = torch.randn(3, matrix.shape[1], dtype=torch.float64)
        want = phiml_torch.sparse_matmul(matrix, b)
        rows = padded_rows(matrix)
        assert rows[0].shape == rows[1].shape == (matrix.shape[0], 5)
        torch.testing.assert_close(_product(rows, b), want, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(_product(padded_rows(matrix.to_sparse_coo()), b), want)
        dense = matrix.to_dense()
        assert torch.equal(_product(dense, b), phiml_torch.sparse_matmul(dense, b))
    with pytest.raises(ValueError, match="sparse CSR, CSC or COO"):
        padded_rows(torch.eye(3))


def test_a_matrix_with_one_long_row_is_multiplied_as_scattered_nonzeros() -> None:
    """PhiML adds a row and a column of ones to a pressure matrix whose mean is free: padded to
    that row, every row held the whole grid (1024 entries at 32x32, 13 ms per block of four
    CG iterations); scattered into their rows, the nonzeros are all there is. Small matrices
    keep their padded rows (and the rounding of their sums)."""
    from phi_torch_jit.adapters.phiml._cg import _product
    from phi_torch_jit.adapters.phiml._forms import PADDED_ENTRIES, product_form

    laplacian = _laplacian(16).to_dense()  # 257 rows padded to 257: past PADDED_ENTRIES
    n = laplacian.shape[0]
    constrained = torch.zeros(n + 1, n + 1, dtype=torch.float64)
    constrained[:n, :n] = laplacian
    constrained[n, :n] = constrained[:n, n] = 1.0
    matrix = constrained.to_sparse_csr()
    form = product_form(matrix)
    assert len(form) == 3 and form[0].numel() == matrix.values().numel()
    b = torch.randn(2, n + 1, dtype=torch.float64)
    want = phiml_torch.sparse_matmul(matrix, b)
    torch.testing.assert_close(_product(form, b), want, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(_product(product_form(matrix.to_sparse_coo()), b), want)
    assert (n + 1) ** 2 > PADDED_ENTRIES
    assert len(product_form(_laplacian(6))) == 2  # five per row: padded rows
    small = constrained[:50, :50].clone()  # a long row too, but few entries: padded still
    assert len(product_form(small.to_sparse_csr())) == 2


def _solves(n: int) -> list[tuple[str, tuple[Any, ...]]]:
    """(what, PhiML's arguments): converging, at rest, max_iter reached, NaN, two right-hand
    sides converging at different iterations."""
    matrix = _laplacian(n)
    g = seeded(0)
    y = torch.randn(2, n * n, generator=g, dtype=torch.float64)
    y[1] *= 1e-3

    def args(rhs: torch.Tensor, max_iter: int, rtol: float = 1e-10) -> tuple[Any, ...]:
        tol_sq = torch.clamp(rtol**2 * (rhs**2).sum(-1), min=1e-30)
        return matrix, rhs, torch.zeros_like(rhs), tol_sq, torch.tensor(max_iter)

    nan = y[:1].clone()
    nan[0, 5] = float("nan")
    return [
        ("converges", args(y[:1], 500)),
        ("at rest", args(torch.zeros_like(y[:1]), 500)),
        ("max_iter", args(y[:1], 7)),
        ("NaN", args(nan, 500)),
        ("batch of 2", args(y, 500, rtol=1e-6)),
    ]


def _assert_same_result(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    x, residual, iterations, evaluations, converged, diverged = got
    torch.testing.assert_close(x, want[0], rtol=1e-9, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(residual, want[1], rtol=1e-7, atol=1e-12, equal_nan=True)
    for a, b in zip((iterations, evaluations, converged, diverged), want[2:]):
        assert torch.equal(a, b), (a, b)


def _uncompiled_solvers() -> Any:
    """The PhiML adapter's captured solvers, as an engine gets them for PhiML's code (its
    blocks run as traced, uncompiled graphs)."""
    from phiml.math import solve_linear

    solvers = _looped.solvers_of(solve_linear, None, threading.Lock())
    assert solvers is not None
    return solvers


@pytest.mark.parametrize("name", SOLVERS)
def test_a_captured_solver_returns_what_phimls_returns(name: str) -> None:
    solvers = _uncompiled_solvers()  # blocks as uncompiled graphs
    for what, args in _solves(8):
        want = _original(name)(*args[:2], args[2].clone(), *args[3:])
        runs = solvers.runs
        with solvers.active():
            got = getattr(phiml_torch, name)(*args[:2], args[2].clone(), *args[3:])
        assert solvers.runs == runs + 1, what
        _assert_same_result(got, want)
        if what == "converges":
            assert int(want[2][0]) > 10
    (loop,) = [loop for loop in solvers.loops() if loop.owner == name]
    assert loop.blocks_run > 0 and not loop.eager_reasons  # ran as blocks, not eagerly


@pytest.mark.parametrize("name", SOLVERS)
def test_the_first_residual_of_one_right_hand_side_is_multiplied_as_csr(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before its loop the solver computes one residual, as plain Python: for a single
    right-hand side that product is PhiML's CSR one (``torch.mv``, 54 us against the padded
    rows' 145 us at 128x128: a tenth of a warm-started Karman solve). Blocks keep the padded
    rows (a CSR product cannot be traced), and so does a batch of right-hand sides."""
    solvers = _uncompiled_solvers()
    mv = torch.mv
    products: list[torch.layout] = []

    def counted(matrix: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
        products.append(matrix.layout)
        return mv(matrix, vector)

    monkeypatch.setattr(torch, "mv", counted)
    for what, args in _solves(8):
        want = _original(name)(*args[:2], args[2].clone(), *args[3:])
        products.clear()
        with solvers.active():
            got = getattr(phiml_torch, name)(*args[:2], args[2].clone(), *args[3:])
        _assert_same_result(got, want)
        single = args[1].shape[0] == 1
        assert products == ([torch.sparse_csr] if single else []), what
    (loop,) = [loop for loop in solvers.loops() if loop.owner == name]
    assert loop.blocks_run > 0 and not loop.eager_reasons


@pytest.mark.parametrize("name", SOLVERS)
def test_the_adjoint_solves_transposed_matrix_runs_the_captured_solver(name: str) -> None:
    """PhiML's adjoint solve (in the backward of a solve) gets the transposed CSR matrix, a CSC
    one: it ran PhiML's own Python CG, 100 ms of a 110 ms PhiFlow gradient step."""
    solvers = _uncompiled_solvers()
    dense = _laplacian(6).to_dense()
    dense[0, 1] += 0.5  # not symmetric: the transpose differs
    dense[1, 0] += 0.5
    dense[2, 3] += 0.25
    transposed = dense.to_sparse_csr().t()
    assert transposed.layout == torch.sparse_csc
    y = torch.randn(2, 36, dtype=torch.float64, generator=seeded(1))
    args = (transposed, y, torch.zeros_like(y), torch.full((2,), 1e-20, dtype=torch.float64),
            torch.full((2,), 200, dtype=torch.int32))  # fmt: skip
    want = _original(name)(*args[:2], args[2].clone(), *args[3:])  # x0 is written in place
    runs = solvers.runs
    with solvers.active():
        got = getattr(phiml_torch, name)(*args[:2], args[2].clone(), *args[3:])
    assert solvers.runs == runs + 1
    _assert_same_result(got, want)
    assert int(want[2][0]) > 10
    torch.testing.assert_close(padded_rows(transposed)[1].sum(-1), dense.t().sum(-1))


def _count_phimls_solves(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], Any]:
    """Calls of PhiML's own ``torch_sparse_cg`` behind its dispatcher are counted (one entry
    each); returns the count and PhiML's function."""
    dispatch = phiml_torch.torch_sparse_cg
    calls: list[int] = []
    original = dispatch.original

    def counted(*args: Any) -> Any:
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(dispatch, "original", counted)
    return calls, original


def test_outside_a_compiled_solve_phiml_runs_its_own_solver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    solvers = _uncompiled_solvers()
    with solvers.active():
        pass  # PhiML's functions are dispatchers from now on
    calls, _ = _count_phimls_solves(monkeypatch)
    _, args = _solves(6)[0]
    runs = solvers.runs
    phiml_torch.torch_sparse_cg(*args)
    assert calls == [1] and solvers.runs == runs


class _Clock:
    """Seconds that pass only when a program below says so: nothing here is timed."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _program(clock: _Clock, mode: str, seconds: float) -> CompiledFunction:
    def run(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        clock.now += seconds
        return tensors

    return CompiledFunction(run, mode)  # type: ignore[arg-type]


def test_the_faster_program_serves_and_the_choice_is_logged(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _Clock()
    monkeypatch.setattr(_looped, "CLOCK", clock)
    target = FunctionTarget(lambda x: (x,), (torch.ones(2),), "forward of solve")
    with caplog.at_level(logging.INFO, logger="phi_torch_jit"):
        chosen = _looped.faster(
            target, _program(clock, "looped", 0.001), _program(clock, "traced", 0.02)
        )
        assert chosen.mode == "looped"
        chosen = _looped.faster(
            target, _program(clock, "looped", 0.02), _program(clock, "traced", 0.001)
        )
        assert chosen.mode == "traced"
    assert "forward of solve: traced serves (looped 20.00 ms, traced 1.00 ms)" in caplog.text


DOMAIN = Box(x=16, y=16)


def _flow(seed: int) -> Any:
    math.seed(seed)
    return StaggeredGrid(Noise(), ZERO_GRADIENT, x=12, y=12, bounds=DOMAIN) * (0.5 + seed)


def project(v: Any) -> tuple[Any, Any]:
    with math.SolveTape() as tape:
        v, _ = fluid.make_incompressible(v, (), Solve("CG-adaptive", 1e-5, 1e-5))
    return v, tape[0].iterations


def _graphed_solve(report: str, which: str) -> bool:
    """Whether ``explain()`` says the solve's ``which`` (forward, backward) serves as a graph of
    PhiML's Python around its captured CG (``engines._solve_graphs``)."""
    lines = [line.strip() for line in report.splitlines() if line.strip().startswith(which + ":")]
    return bool(lines) and all(
        "loop of PhiML's torch_sparse_cg" in line and "Python around it captured as a graph" in line
        for line in lines
    )


@pytest.fixture
def captured_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """The captured form (the first program offered) serves whatever it measures (on this
    small grid PhiML's Python around the solve may cost more than the loop saves)."""

    def captured_first(target: Any, *programs: CompiledFunction) -> CompiledFunction:
        return programs[0]

    monkeypatch.setattr(compile_engine, "faster", captured_first)


@pytest.mark.slow
@pytest.mark.usefixtures("captured_serves")
@pytest.mark.uses_torchscript  # engine "compile": TorchScript compiles its custom-function bodies
def test_a_jitted_phiflow_solve_runs_phimls_cg_captured_and_equals_eager() -> None:
    jitted = ptj.jit(project, engine="compile", backend="aot_eager", fallback="off")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for v in (_flow(0), _flow(1), _flow(2) * 0):  # the last at rest: zero iterations
            with phiml_eager():
                want_v, want_iterations = project(v)
            got_v, got_iterations = jitted(v)
            assert got_iterations.numpy().tolist() == want_iterations.numpy().tolist()
            assert float(math.max(abs(got_v.values - want_v.values))) < 1e-5
    assert not [w for w in caught if issubclass(w.category, ptj.JitWarning)]
    assert jitted.num_traces == 1
    report = jitted.explain()
    assert _graphed_solve(report, "forward"), report


@pytest.mark.slow
@pytest.mark.usefixtures("captured_serves")
@pytest.mark.uses_torchscript  # engine "compile": TorchScript compiles its custom-function bodies
def test_a_captured_phiml_solve_raises_its_solver_errors_as_eagerly() -> None:
    def starved(v: Any) -> Any:
        return fluid.make_incompressible(v, (), Solve("CG", 1e-9, 1e-9, max_iterations=3))[0]

    jitted = ptj.jit(starved, engine="compile", backend="aot_eager", fallback="off")
    jitted(_flow(0) * 0)  # at rest: converges at once; the solve is compiled
    assert _graphed_solve(jitted.explain(), "forward")  # its checks deferred, run on each call
    with pytest.raises(math.NotConverged) as eager, phiml_eager():
        starved(_flow(1))
    with pytest.raises(math.NotConverged) as compiled:
        jitted(_flow(1))
    assert str(compiled.value) == str(eager.value)


@pytest.mark.slow
@pytest.mark.usefixtures("captured_serves")
@pytest.mark.uses_torchscript  # engine "compile": TorchScript compiles its custom-function bodies
def test_gradients_through_a_captured_phiml_solve_equal_eager() -> None:
    def loss(v: Any) -> Any:
        v, _ = fluid.make_incompressible(v, (), Solve("CG", 1e-5, 1e-5))
        return field.l2_loss(v)

    gradient = field.functional_gradient(loss, "v", get_output=False)
    jitted = field.functional_gradient(
        ptj.jit(loss, engine="compile", backend="aot_eager", fallback="off"), "v", get_output=False
    )
    for seed in range(2):
        v = _flow(seed)
        with phiml_eager():
            want = gradient(v)
        got = jitted(v)
        assert float(math.max(abs(got.values - want.values))) < 1e-5


def test_a_phiml_whose_solvers_differ_keeps_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another PhiML release (a solver with other parameters): nothing is replaced, PhiML's
    function runs, and the engine sees that no captured solver ran."""
    from phi_torch_jit.adapters.phiml import _cg as _phiml_cg

    phimls = _original("torch_sparse_cg")

    def torch_sparse_cg(matrix: Any, y: Any, x0: Any, tolerance_sq: Any, max_iter: Any) -> Any:
        return phimls(matrix, y, x0, tolerance_sq, max_iter)

    monkeypatch.setattr(_phiml_cg, "_DISPATCHERS", {})
    monkeypatch.setattr(phiml_torch, "torch_sparse_cg", torch_sparse_cg)
    solvers = _phiml_cg.Solvers(lambda fn, label: pytest.fail("nothing is captured"))
    _, args = _solves(6)[0]
    with solvers.active():
        got = phiml_torch.torch_sparse_cg(*args[:2], args[2].clone(), *args[3:])
    assert phiml_torch.torch_sparse_cg is torch_sparse_cg  # not replaced
    assert solvers.runs == 0
    assert solvers.captured("torch_sparse_cg") == (
        "PhiML's CG functions are not the ones phi_torch_jit knows"
    )
    _assert_same_result(got, phimls(*args[:2], args[2].clone(), *args[3:]))


def _over_same_parts(matrix: torch.Tensor) -> torch.Tensor:
    """A new sparse tensor over ``matrix``'s own index and value tensors, as PhiFlow passes the
    same matrix to every step's solve."""
    return torch.sparse_csr_tensor(
        matrix.crow_indices(), matrix.col_indices(), matrix.values(), matrix.shape
    )


def test_a_matrix_over_the_same_parts_is_put_in_product_form_once_until_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Building the padded rows took 1.06 ms of a 7.4 ms heat step, for the same matrix every
    step. Kept per matrix, they are built again after an in-place write to the matrix, for
    another matrix, and every time for values that require grad (never kept)."""
    from phi_torch_jit.adapters.phiml import _forms as _phiml_forms

    built: list[int] = []
    product_form = _phiml_forms.product_form

    def counted(matrix: torch.Tensor) -> tuple[torch.Tensor, ...]:
        built.append(1)
        return product_form(matrix)

    monkeypatch.setattr(_phiml_forms, "product_form", counted)
    solvers = _uncompiled_solvers()
    matrix = _laplacian(6)
    _, args = _solves(6)[0]

    def solve(m: torch.Tensor) -> Any:
        with solvers.active():
            return phiml_torch.torch_sparse_cg(m, args[1], args[2].clone(), *args[3:])

    for _ in range(3):
        _assert_same_result(solve(_over_same_parts(matrix)), solve(matrix))
    assert len(built) == 1
    matrix.values().mul_(2.0)  # written in place: the kept form is stale
    want = _original("torch_sparse_cg")(matrix, args[1], args[2].clone(), *args[3:])
    _assert_same_result(solve(_over_same_parts(matrix)), want)
    assert len(built) == 2
    coo = matrix.to_sparse_coo().coalesce()
    solve(coo), solve(coo)
    assert len(built) == 3
    weights = matrix.values().clone().requires_grad_()
    graded = torch.sparse_csr_tensor(matrix.crow_indices(), matrix.col_indices(), weights, (36, 36))
    with torch.no_grad():
        solve(graded), solve(graded)
    assert len(built) == 5


def test_phimls_colour_check_skips_its_stack_walk_inside_a_captured_solve(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PhiML's solve formats its ``Solve`` for a debug message with logging off too, and
    asked, through ``check_is_printing``, whether a ``print(`` is on the stack: a walk of the
    whole stack, 1.3-1.5 ms of a heat step. Inside a captured solve the answer is False (plain
    text, as wherever nothing prints) and the stack is not walked; outside, PhiML asks."""
    import traceback

    from phiml.math import _tensors as phiml_tensors

    solvers = _uncompiled_solvers()
    with solvers.active():
        pass  # installed
    walks: list[int] = []
    extract_stack = traceback.extract_stack

    def counted(*args: Any, **kwargs: Any) -> Any:
        walks.append(1)
        return extract_stack(*args, **kwargs)

    monkeypatch.setattr(traceback, "extract_stack", counted)
    tolerance = math.tensor(1e-5)
    with solvers.active():
        inside = f"{Solve('CG', tolerance, tolerance)}"
        assert phiml_tensors.check_is_printing() is False
    assert walks == []
    assert f"{Solve('CG', tolerance, tolerance)}" == inside
    assert walks


class _Tiered:
    """A block as engine auto serves it: straight-line until its compile switches it."""

    def __init__(self, graph: torch.fx.GraphModule) -> None:
        self.graph = graph
        self.straight_line = True

    def __call__(self, *tensors: torch.Tensor) -> Any:
        return self.graph(*tensors)


def test_while_its_blocks_run_straight_line_phimls_own_loop_serves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Uncompiled, the captured CG's blocks (padded-row products, predicated iterations) took
    12.7 ms where PhiML's loop took 4.1 ms (13 iterations, 128x128): while engine auto compiles
    them, a heat step served on the straight-line tier at 45 ms against eager's 37 ms. The
    first solve runs captured (it builds the blocks); until they are compiled PhiML's loop
    serves; then the blocks."""
    from phiml.math import solve_linear

    blocks: list[_Tiered] = []

    def tiered(graph: torch.fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> _Tiered:
        blocks.append(_Tiered(graph))
        return blocks[-1]

    solvers = _looped.solvers_of(solve_linear, tiered, threading.Lock())
    assert solvers is not None
    with solvers.active():
        pass  # installed
    assert not isinstance(solvers.captured("torch_sparse_cg"), str)  # from PhiML's function
    calls, original = _count_phimls_solves(monkeypatch)
    _, args = _solves(8)[0]
    want = original(*args[:2], args[2].clone(), *args[3:])

    def solve() -> Any:
        with solvers.active():
            return phiml_torch.torch_sparse_cg(*args[:2], args[2].clone(), *args[3:])

    _assert_same_result(solve(), want)
    assert blocks and solvers.runs == 1 and calls == []  # captured: the blocks are built
    _assert_same_result(solve(), want)
    assert solvers.runs == 1 and calls == [1]  # straight-line blocks: PhiML's loop
    checked = solvers.calling(phiml_torch.torch_sparse_cg)  # an engine's new captured body
    _assert_same_result(checked(*args[:2], args[2].clone(), *args[3:]), want)
    assert solvers.runs == 2 and calls == [1]  # its first call, the engine's check: captured
    _assert_same_result(checked(*args[:2], args[2].clone(), *args[3:]), want)
    assert solvers.runs == 2 and calls == [1, 1]  # then as any solve
    for block in blocks:
        block.straight_line = False  # compiled
    _assert_same_result(solve(), want)
    assert solvers.runs == 3 and calls == [1, 1]


@pytest.mark.slow
def test_an_adjoint_solve_met_while_the_forwards_blocks_run_straight_line_is_captured() -> None:
    """The captured solvers are shared by an engine's solves. While engine auto has not
    compiled the blocks the forward's solve built, PhiML's own loop serves (above); the
    backward's check against its recording ran that loop too, counted no captured solve, and
    refused the backward: PhiML's adjoint ran as its Python CG, a gradient step through two
    smoke steps 2x slower (57 ms against 25-28 ms). The check runs the captured solver."""

    def loss(v: Any) -> Any:
        v, _ = fluid.make_incompressible(v, (), Solve("CG", 1e-5, 1e-5))
        return field.l2_loss(v)

    gradient = field.functional_gradient(loss, "v", get_output=False)
    jitted = ptj.jit(loss, engine="auto", backend="aot_eager")  # blocks straight-line at first
    compiled = field.functional_gradient(jitted, "v", get_output=False)
    for seed in range(2):  # two calls: no compile is queued, the blocks stay straight-line
        v = _flow(seed)
        with phiml_eager():
            want = gradient(v)
        got = compiled(v)
        assert float(math.max(abs(got.values - want.values))) < 1e-5
    report = jitted.explain()
    assert _graphed_solve(report, "forward"), report
    # the adjoint's transposed matrix (CSC) is built inside its capture: Python around its CG
    assert "backward for needs_input_grad=(True,): looped (loop of PhiML's" in report, report


def test_a_captured_solve_reproduces_to_the_solves_tolerance_not_to_float_rounding() -> None:
    """``_solve_graphs.solved_alike``: floating outputs within SOLVE_RTOL of their largest value
    (the CG stopped at a residual tolerance, rows summed in another order), counts and flags
    exactly; shapes and dtypes as recorded."""
    x = torch.linspace(0.0, 0.43, 64).reshape(2, 32)
    counts, flags = torch.tensor([31, 29], dtype=torch.int32), torch.tensor([True, True])
    recorded = (x, counts, flags)
    near = x + 3.8e-5 * torch.sign(torch.sin(torch.arange(64.0))).reshape(2, 32)
    assert not _looped._reproduces((near, counts, flags), recorded)  # float rounding: no
    assert _solve_graphs.solved_alike((near, counts, flags), recorded)
    assert not _solve_graphs.solved_alike((x + 1e-3, counts, flags), recorded)  # beyond it
    assert not _solve_graphs.solved_alike((x, counts + 1, flags), recorded)  # another count
    assert not _solve_graphs.solved_alike((x, counts, ~flags), recorded)
    assert not _solve_graphs.solved_alike((x.double(), counts, flags), recorded)
    assert not _solve_graphs.solved_alike((x,), recorded)


def _pipe_step(v: Any, p: Any) -> Any:
    from phi.torch.flow import advect, diffuse

    v = advect.semi_lagrangian(v, v, 1.0)
    v = diffuse.explicit(v, 0.1, 1.0)
    return fluid.make_incompressible(v, solve=Solve("CG-adaptive", 1e-5, x0=p))


@pytest.mark.slow
def test_a_pipe_flows_solve_is_captured_though_it_differs_from_eager_by_its_tolerance() -> None:
    """A 50x32 pipe flow's 'CG-adaptive' pressure solve: the captured solver's solution was
    8.7e-5 of its largest value from the recorded one (float32, tolerance 1e-5), the check
    at float rounding refused it, and the solve ran as PhiML's Python on every call (1.9x
    engine compile's step). It is looped now, and the step stays as close to eager as PhiML's
    own jit is."""
    from phi.torch.flow import extrapolation, vec

    boundary = extrapolation.combine_sides(x=(vec(x=1, y=0), ZERO_GRADIENT), y=0)
    state = _pipe_step(StaggeredGrid(0, boundary, x=50, y=32), None)
    jitted = ptj.jit(_pipe_step, engine="auto", backend="aot_eager", compile_on="caller")
    for _ in range(3):
        got = jitted(*state)
        with phiml_eager():
            want = _pipe_step(*state)
        scale = float(math.max(abs(want[0].values)))
        assert float(math.max(abs(got[0].values - want[0].values))) < 1e-3 * scale
        state = want
    assert _graphed_solve(jitted.explain(), "forward"), jitted.explain()
