"""Loop capture's prologues (``phi_torch_jit._loops._prologue``, NOTE [a compiled prologue] in
docs/loops.md): the plain assignments right before a captured loop run as one graph per input
signature. Results, identities and in-place writes equal the Python statements'; what a graph
cannot repeat runs them as Python."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from helpers import Counter
from test_loops import _like_eager_with_gradients

import phi_torch_jit as ptj
from phi_torch_jit._loops import Captured, capture_loops

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.devices]

CALLS = Counter()


def counted_norm(r: torch.Tensor) -> torch.Tensor:
    CALLS.forward += 1  # counts Python runs of the statements before the loop
    return (r * r).sum()


def stencil(d: torch.Tensor) -> torch.Tensor:
    return 1.5 * d - 0.25 * (torch.roll(d, 1, -1) + torch.roll(d, -1, -1))


def cg(b: torch.Tensor, x0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x0
    r = b - stencil(x)
    d = r.clone()
    rs = counted_norm(r)
    tol = 1e-20 * (b * b).sum() + 1e-30
    it = 0
    while bool(rs > tol) and it < 200:
        ad = stencil(d)
        alpha = rs / (d * ad).sum()
        x += alpha * d  # x0 itself, written in place, as PhiML's CG does
        r = r - alpha * ad
        rs, rs_old = (r * r).sum(), rs
        d = r + rs / rs_old * d
        it += 1
    return x, torch.tensor(it)


def _captured(fn: Any) -> Captured:
    captured = capture_loops(fn, fn.__name__, None, block=4)
    assert isinstance(captured, Captured), captured
    return captured


def _rhs(n: int = 12, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(2, n, generator=g, dtype=torch.float64).to(torch.get_default_device())


def test_the_statements_before_a_loop_run_as_one_graph_and_equal_python() -> None:
    captured = _captured(cg)
    (prologue,) = captured.prologues
    assert "the statements before it as a graph" in captured.describe()
    b = _rhs()
    with torch.no_grad():
        for _ in range(3):
            x0, x0_eager = torch.zeros_like(b), torch.zeros_like(b)
            before = CALLS.forward
            x, it = captured.function(b, x0)
            ran = CALLS.forward - before
            x_eager, it_eager = cg(b, x0_eager)
            assert torch.equal(x, x_eager) and int(it) == int(it_eager) > 4
            assert x is x0 and torch.equal(x0, x0_eager)  # x0 passed through, written in place
    assert ran == 0  # the third call: the graph, not the statements
    assert prologue.graph_runs == 3 and len(prologue.graphs) == 1


def test_a_new_shape_or_a_new_python_value_gets_its_own_graph() -> None:
    def scaled(b: torch.Tensor, scale: float) -> torch.Tensor:
        y = b * scale
        r = y - 1
        while bool(r.abs().max() > 1):
            r = r / 2
        return r

    captured = _captured(scaled)
    with torch.no_grad():
        for b, scale in [(_rhs(8), 3.0), (_rhs(8), 5.0), (_rhs(6), 5.0), (_rhs(8), 3.0)]:
            assert torch.equal(captured.function(b, scale), scaled(b, scale))
    (prologue,) = captured.prologues
    assert len(prologue.graphs) == 3 and prologue.graph_runs == 4


def test_two_names_for_one_tensor_stay_one_tensor() -> None:
    def shared(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = c = b * 2
        n = 0
        while n < 3:
            a.add_(1)  # c is the same tensor: it sees the writes
            n += 1
        return a, c

    captured = _captured(shared)
    with torch.no_grad():
        for _ in range(2):
            a, c = captured.function(torch.ones(3))
            assert a is c and torch.equal(c, torch.full((3,), 5.0))
    assert captured.prologues[0].graph_runs == 2


def test_a_result_that_views_an_input_runs_the_statements_as_python(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def first_row(y: torch.Tensor) -> torch.Tensor:
        v = y[0]  # a view: the loop's writes reach y, as in Python
        k = 0
        while k < 2:
            v += 1
            k += 1
        return y

    captured = _captured(first_row)
    y, y_eager = torch.zeros(2, 3), torch.zeros(2, 3)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="phi_torch_jit"):
        captured.function(y)
    first_row(y_eager)
    assert torch.equal(y, y_eager) and y[0].eq(2).all()
    (prologue,) = captured.prologues
    (why,) = prologue.graphs.values()
    assert isinstance(why, str) and "shares memory" in why and prologue.graph_runs == 0
    assert any("run as Python for these inputs" in r.getMessage() for r in caplog.records)


def test_a_value_read_on_the_host_or_grad_mode_runs_the_statements_as_python() -> None:
    def host(b: torch.Tensor) -> torch.Tensor:
        peak = float(b.abs().max())  # a value read on the host: no graph can hold it
        r = b / peak
        while bool(r.abs().max() > 0.1):
            r = r / 2
        return r

    captured = _captured(host)
    b = _rhs()
    with torch.no_grad():
        assert torch.equal(captured.function(b), host(b))
        assert torch.equal(captured.function(b * 3), host(b * 3))  # not baked
    (prologue,) = captured.prologues
    assert prologue.graph_runs == 0 and all(isinstance(g, str) for g in prologue.graphs.values())

    plain = _captured(cg)
    with torch.enable_grad():
        x, _ = plain.function(b, torch.zeros_like(b))
    assert torch.equal(x, cg(b, torch.zeros_like(b))[0]) and plain.prologues[0].graph_runs == 0


def test_only_plain_assignments_right_before_the_loop_are_taken() -> None:
    log: list[float] = []

    def mixed(b: torch.Tensor) -> torch.Tensor:
        s = b.sum()
        log.append(1.0)  # a call for its effect: the run before the loop starts after it
        r = b * 2
        r2 = r + 1
        while bool(r2.abs().max() > 1):
            r2 = r2 / 2
        return r2 + s

    captured = _captured(mixed)
    (prologue,) = captured.prologues
    b = _rhs()
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(captured.function(b), mixed(b))
    assert len(log) == 4 and prologue.graph_runs == 2

    def short(b: torch.Tensor) -> torch.Tensor:
        r = b * 2  # one statement: not worth a graph
        while bool(r.abs().max() > 1):
            r = r / 2
        return r

    assert _captured(short).prologues == ()


def from_rest(b: torch.Tensor) -> torch.Tensor:
    x, _ = cg(b, torch.zeros_like(b))
    return x


def adjoint(g: torch.Tensor) -> torch.Tensor:
    return solve(g)  # a symmetric operator: the adjoint is the same solve


solve = ptj.custom_gradient(
    from_rest, lambda inputs, outputs, grads: (adjoint(grads[0]),), name="cg_with_prologue"
)


def step(v: torch.Tensor) -> torch.Tensor:
    return solve(v * 2)


def test_a_jitted_cg_step_serves_its_prologue_as_a_graph_and_equals_eager() -> None:
    jitted = _like_eager_with_gradients(step, "aot_eager", 10, engine="auto", compile_on="caller")
    assert "the statements before it as a graph" in jitted.explain()
