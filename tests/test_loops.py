"""Loop capture (``phi_torch_jit._loops``, docs/loops.md): loops in custom functions run as
blocks of predicated iterations. Results, iteration counts, in-place writes, states at rest,
NaN and gradients equal the Python loop's; loops it cannot capture keep the Python path."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import Counter

import phi_torch_jit as ptj
from phi_torch_jit._loops import Captured, capture_loops

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.devices]


def _captured(fn: Any, block: int = 4) -> Captured:
    captured = capture_loops(fn, fn.__name__, None, block=block)
    assert isinstance(captured, Captured), captured
    return captured


def laplace(d: torch.Tensor) -> torch.Tensor:
    neighbours = torch.roll(d, 1, -1) + torch.roll(d, -1, -1) + torch.roll(d, 1, -2)
    return 0.01 * d - (neighbours + torch.roll(d, -1, -2) - 4 * d)


def cg(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros_like(b)
    r = b.clone()
    d = r.clone()
    rs = (r * r).sum()
    tol = 1e-10 * (b * b).sum() + 1e-30
    it = 0
    while bool(rs > tol) and it < 300:
        ad = laplace(d)
        alpha = rs / (d * ad).sum()
        x += alpha * d  # in place, as solvers are often written
        r -= alpha * ad
        rs_new = (r * r).sum()
        d = r + rs_new / rs * d
        rs = rs_new
        it += 1
    return x, torch.tensor(it)


def _rhs(n: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    b = torch.randn(1, n, n, generator=g, dtype=torch.float64, device="cpu")
    return (b - b.mean()).to(torch.get_default_device())


def test_a_while_loop_with_bool_and_an_int_counter_equals_the_python_loop() -> None:
    captured = _captured(cg)
    b = _rhs()
    x, it = captured.function(b)
    x_eager, it_eager = cg(b)
    assert torch.equal(x, x_eager) and int(it) == int(it_eager) > 4
    (loop,) = captured.loops
    assert loop.blocks_run == -(-int(it_eager) // 4)  # one host check per block of 4


def test_states_at_rest_nan_and_max_iterations_equal_the_python_loop() -> None:
    captured = _captured(cg)
    loop = captured.loops[0]
    zero = torch.zeros(1, 8, 8, dtype=torch.float64)  # at rest: no iteration, no block
    x, it = captured.function(zero)
    assert int(it) == 0 and torch.equal(x, zero) and loop.blocks_run == 0
    nan = _rhs(8)
    nan[0, 0, 0] = float("nan")  # rs > tol is False for NaN: no iteration, as eagerly
    x, it = captured.function(nan)
    x_eager, it_eager = cg(nan)
    assert int(it) == int(it_eager) and torch.equal(x, x_eager)

    def capped(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.zeros_like(b)
        r = b.clone()
        it = 0
        while bool((r * r).sum() > 1e-30) and it < 7:  # never converges: max_iter
            x = x + 0.1 * r
            r = r - 0.1 * laplace(r)
            it += 1
        return x, torch.tensor(it)

    x, it = _captured(capped, block=3).function(_rhs())
    assert int(it) == 7 and torch.equal(x, capped(_rhs())[0])  # 7 is no multiple of 3


def test_for_range_with_a_break_and_while_true_with_a_break() -> None:
    def damped(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        steps = torch.zeros((), dtype=torch.int64)
        for _ in range(50):
            if bool(x.abs().max() < 0.01):
                break
            x = 0.7 * x
            steps = steps + 1
        return x, steps

    def halving(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = 0
        while True:
            x = x / 2
            n += 1
            if bool(x.abs().max() < 1) or n >= 40:
                break
        return x, torch.tensor(n)

    for fn in (damped, halving):
        captured = _captured(fn)
        for scale in (0.001, 3.0, 1e6):
            x = torch.linspace(-1, 1, 9, dtype=torch.float64) * scale
            got, want = captured.function(x), fn(x)
            assert torch.equal(got[0], want[0]) and int(got[1]) == int(want[1])


def test_a_carried_tensor_written_in_place_is_written_like_the_python_loop() -> None:
    def relax(x: torch.Tensor) -> torch.Tensor:
        n = 0
        while n < 5:
            x.mul_(0.5)  # the caller's tensor, written in place
            n += 1
        return x * 1

    captured = _captured(relax)
    x, x_eager = torch.ones(3), torch.ones(3)
    out = captured.function(x)
    relax(x_eager)
    assert torch.equal(x, x_eager) and torch.equal(out, x_eager)


def test_a_closure_rebound_later_is_seen() -> None:
    factor = 0.5

    def shrink(x: torch.Tensor) -> torch.Tensor:
        while bool(x.abs().max() > 1):
            x = x * factor
        return x

    captured = _captured(shrink, block=2)
    x = torch.full((2,), 10.0)
    assert torch.equal(captured.function(x), shrink(x))
    factor = 0.25
    assert torch.equal(captured.function(x), shrink(x))


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("while bool(x.sum() > 0):\n        return x", "return"),
        ("while bool(x.sum() > 0):\n        x = x - 1\n        continue", "continue"),
        ("for v in x:\n        x = x - v", "range"),
        ("while bool(x.sum() > 0):\n        x = x - 1\n    else:\n        pass", "else"),
        ("while True:\n        x = x - 1", "no exit"),
        ("while bool(y.sum() > 0):\n        y = y - 1", "unbound"),
        ("while bool(x.sum() > 0):\n        x = x - 1\n        print(x)", "`print`"),
        ("while bool(x.sum() > 0):\n        x = x - 1\n        seen.append(x)", "side effect"),
    ],
)
def test_loops_it_cannot_capture_say_why(source: str, reason: str, tmp_path: Path) -> None:
    namespace: dict[str, Any] = {}
    text = f"def f(x):\n    {source}\n    return x\n"
    path = str(tmp_path / "loop_source.py")  # a file: loop capture reads the source
    with open(path, "w") as file:
        file.write(text)
    exec(compile(text, path, "exec"), namespace)
    import linecache

    linecache.checkcache(path)
    result = capture_loops(namespace["f"], "f", None)
    assert isinstance(result, str) and reason in result, result


def test_a_body_the_block_cannot_trace_runs_the_iterations_eagerly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def stepwise(x: torch.Tensor) -> torch.Tensor:
        while bool(x.max() > 1):
            x = x - float(x.max()) / 4  # float(): a value read on the host
        return x

    captured = _captured(stepwise)
    x = torch.tensor([5.0, 3.0])
    with caplog.at_level(logging.INFO, logger="phi_torch_jit"):
        assert torch.equal(captured.function(x), stepwise(x))
    assert captured.loops[0].blocks_run == 0
    assert any("runs eagerly for these inputs" in r.getMessage() for r in caplog.records)


def solve(b: torch.Tensor) -> torch.Tensor:
    """CG for a custom gradient: the loop is in the forward itself (loops in functions it
    calls are not captured)."""
    x, r = torch.zeros_like(b), b.clone()
    d, rs = r.clone(), (r * r).sum()
    for _ in range(200):
        if bool(rs < 1e-20 * (b * b).sum() + 1e-30):
            break
        ad = laplace(d)
        alpha = rs / (d * ad).sum()
        x, r = x + alpha * d, r - alpha * ad
        rs, rs_old = (r * r).sum(), rs
        d = r + rs / rs_old * d
    return x


cg_solve = ptj.custom_gradient(
    solve, lambda inputs, outputs, grads: (cg_grad(grads[0]),), name="cg"
)


def cg_grad(g: torch.Tensor) -> torch.Tensor:
    return cg_solve(g)  # symmetric operator: the adjoint is the same solve


def _step(v: torch.Tensor) -> torch.Tensor:
    return cg_solve(v * 2)


def _like_eager_with_gradients(step: Any, backend: str, n: int, **options: Any) -> Any:
    """``step`` jitted (engine compile unless ``options`` say, ``backend``) on three
    right-hand sides: values and gradients equal eager's, one trace; the jitted function."""
    options.setdefault("engine", "compile")
    jitted = ptj.jit(step, backend=backend, fallback="off", **options)
    for seed in range(3):
        v = _rhs(n, seed).requires_grad_(True)
        v_eager = v.detach().clone().requires_grad_(True)
        out, out_eager = jitted(v), step(v_eager)
        torch.testing.assert_close(out, out_eager, rtol=1e-6, atol=1e-9)
        out.square().sum().backward()
        out_eager.square().sum().backward()
        torch.testing.assert_close(v.grad, v_eager.grad, rtol=1e-6, atol=1e-9)
    assert jitted.num_traces == 1
    return jitted


@pytest.mark.parametrize("engine", ["aot_eager", "inductor"])
@pytest.mark.uses_torchscript  # engine "compile": TorchScript compiles its custom-function bodies
def test_a_jitted_cg_step_is_looped_and_equals_eager_with_gradients(engine: str) -> None:
    jitted = _like_eager_with_gradients(_step, engine, 12)
    report = jitted.explain()
    assert "forward: looped" in report
    (call,) = jitted.specializations[0].calls
    (adjoint,) = call.nested.calls.values()  # the solve inside the gradient: captured too
    assert adjoint.forward.mode == "looped"


@pytest.mark.uses_torchscript  # engine "compile": TorchScript compiles its custom-function bodies
def test_loops_false_keeps_the_functions_engine() -> None:
    jitted = ptj.jit(_step, engine="compile", backend="aot_eager", loops=False)
    jitted(_rhs(6))
    assert "forward: looped" not in jitted.explain()


def _removed(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("TorchScript is unavailable")


def test_without_torchscript_the_loop_is_still_captured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.jit, "trace", _removed)
    monkeypatch.setattr(torch.jit, "script", _removed)
    jitted = ptj.jit(_step, engine="compile", backend="aot_eager", fallback="off")
    for seed in range(2):
        v = _rhs(8, seed)
        torch.testing.assert_close(jitted(v), _step(v), rtol=1e-6, atol=1e-9)
    assert "forward: looped" in jitted.explain() and jitted.num_traces == 1


def test_a_tensor_valued_if_inside_the_body_is_captured() -> None:
    def bisect(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = 0
        while bool(hi - lo > 1e-9) and n < 100:
            mid = (lo + hi) / 2
            if bool(mid * mid > 2):  # a branch on a value: where() in a block
                hi = mid
            else:
                lo = mid
            n += 1
        return lo, torch.tensor(n)

    captured = _captured(bisect)
    lo, hi = torch.tensor(0.0, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64)
    got, want = captured.function(lo, hi), bisect(lo, hi)
    assert torch.equal(got[0], want[0]) and int(got[1]) == int(want[1]) > 20
    assert captured.loops[0].blocks_run > 0 and not any(
        isinstance(p, str) for p in captured.loops[0].programs.values()
    )  # traced as blocks, not run eagerly


class NewtonSqrt(torch.autograd.Function):
    """A Newton iteration in an autograd.Function forward, as users write one."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        x = torch.ones_like(a)
        n = 0
        while bool((x * x - a).abs().max() > 1e-12) and n < 60:
            x = (x + a / x) / 2
            n += 1
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad / (2 * x)


def _sqrt_step(a: torch.Tensor) -> torch.Tensor:
    return NewtonSqrt.apply(a * 1.5) + 1  # type: ignore[no-any-return]


@pytest.mark.uses_torchscript  # engine "compile": TorchScript compiles its custom-function bodies
def test_a_loop_in_an_autograd_function_forward_is_captured() -> None:
    jitted = ptj.jit(_sqrt_step, engine="compile", backend="aot_eager", fallback="off")
    for scale in (1.0, 100.0, 1e-3):
        a = (torch.rand(5, dtype=torch.float64) + 0.1) * scale
        a.requires_grad_(True)
        a_eager = a.detach().clone().requires_grad_(True)
        out, want = jitted(a), _sqrt_step(a_eager)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(
            *torch.autograd.grad(out.sum(), a), *torch.autograd.grad(want.sum(), a_eager)
        )
    assert "forward: looped" in jitted.explain() and jitted.num_traces == 1


@pytest.mark.cuda
def test_on_cuda_blocks_of_16_keep_the_loop_on_the_device() -> None:
    from phi_torch_jit._loops import BLOCK_CUDA

    captured = capture_loops(cg, "cg", None)  # the device's block size
    assert isinstance(captured, Captured)
    b = _rhs(32).cuda()
    x, it = captured.function(b)
    x_eager, it_eager = cg(b)
    torch.testing.assert_close(x, x_eager)
    assert int(it) == int(it_eager)
    assert captured.loops[0].blocks_run == -(-int(it_eager) // BLOCK_CUDA)  # host checks


def _make_plain_cg(operator: Any) -> Any:
    def plain_cg(b: torch.Tensor, *, max_iter: int = 300) -> torch.Tensor:
        """Not scriptable (a closure operator, a keyword-only argument): still captured."""
        x, r = torch.zeros_like(b), b.clone()
        d, rs = r.clone(), (r * r).sum()
        it = 0
        while bool(rs > 1e-20) and it < max_iter:
            ad = operator(d)
            alpha = rs / (d * ad).sum()
            x, r = x + alpha * d, r - alpha * ad
            rs, rs_old = (r * r).sum(), rs
            d = r + rs / rs_old * d
            it += 1
        return x

    return plain_cg


def test_a_cg_with_a_closure_operator_runs_as_blocks_not_eagerly() -> None:
    plain_cg = _make_plain_cg(laplace)
    captured = _captured(plain_cg)
    b = _rhs(10)
    assert torch.equal(captured.function(b), plain_cg(b))
    (loop,) = captured.loops
    assert loop.blocks_run > 0 and not loop.eager_reasons


def _shrink_on_host(x: torch.Tensor) -> torch.Tensor:
    while bool(x.max() > 1):
        x = x - float(x.max()) / 4  # a value read on the host: no block can be traced
    return x


shrink_on_host = ptj.custom_gradient(_shrink_on_host, lambda i, o, g: (g[0],), name="shrink")


@pytest.mark.uses_torchscript  # engine "compile": TorchScript compiles its custom-function bodies
def test_a_forward_whose_block_cannot_be_traced_keeps_the_functions_engine(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Iterations run eagerly with copies and merges are slower than the Python loop: such a
    forward is not served looped at all."""
    jitted = ptj.jit(lambda x: shrink_on_host(x) + 1, engine="compile", backend="aot_eager")
    x = torch.tensor([5.0, 3.0])
    with caplog.at_level(logging.INFO, logger="phi_torch_jit"):
        torch.testing.assert_close(jitted(x), _shrink_on_host(x) + 1)
    assert "forward: looped" not in jitted.explain()
    assert any("a block cannot be traced" in r.getMessage() for r in caplog.records)


def test_a_flag_set_by_bool_in_the_body_is_captured() -> None:
    def relax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        done = False
        n = 0
        while not done:
            x = 0.5 * x
            n += 1
            done = bool(x.abs().max() < 1e-3) or n >= 100
        return x, torch.tensor(n)

    captured = _captured(relax)
    for scale in (0.0, 1.0, 1e9, float("inf")):
        x = torch.full((3,), scale)
        got, want = captured.function(x), relax(x)
        assert torch.equal(got[0], want[0]) and int(got[1]) == int(want[1])
    (loop,) = captured.loops
    assert loop.blocks_run > 0 and not loop.eager_reasons


def test_a_busy_tracing_lock_runs_the_call_eagerly_and_the_next_call_compiles() -> None:
    import threading

    lock = threading.Lock()
    captured = capture_loops(cg, "cg", None, block=4, lock=lock)
    assert isinstance(captured, Captured)
    (loop,) = captured.loops
    b = _rhs(8)
    with lock:  # engine auto's thread compiling: never waited for
        x, _ = captured.function(b)
    assert torch.equal(x, cg(b)[0]) and loop.blocks_run == 0 and not loop.programs
    x, _ = captured.function(b)
    assert torch.equal(x, cg(b)[0]) and loop.blocks_run > 0


class NotConverged(RuntimeError):
    """A solver's own error after its loop."""


def _strict(b: torch.Tensor) -> torch.Tensor:
    x = torch.zeros_like(b)
    it = 0
    while bool((b - x).abs().max() > 1e-6) and it < 6:
        x = x + 0.5 * (b - x)
        it += 1
    if bool((b - x).abs().max() > 1e-6):
        raise NotConverged(f"no convergence within {it} iterations")
    return x


strict = ptj.custom_gradient(_strict, lambda i, o, g: (g[0],), name="strict")


@pytest.mark.uses_torchscript  # engine "compile": TorchScript compiles its custom-function bodies
def test_a_solver_error_after_a_captured_loop_is_raised_as_eagerly() -> None:
    jitted = ptj.jit(lambda b: strict(b) * 2, engine="compile", backend="aot_eager")
    easy = torch.full((3,), 1e-6)
    torch.testing.assert_close(jitted(easy), _strict(easy) * 2)
    assert "forward: looped" in jitted.explain()
    hard = torch.full((3,), 10.0)
    with pytest.raises(NotConverged, match="within 6 iterations"):
        _strict(hard)
    with pytest.raises(NotConverged, match="within 6 iterations"):
        jitted(hard)
    torch.testing.assert_close(jitted(easy * 2), _strict(easy * 2) * 2)  # still compiled
    assert jitted.num_traces == 1


# -- loops in the functions a custom function calls (``_loops._callees``) ---------------------


def _solve_twice(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A forward whose solver loop is in a function it calls, two levels down."""
    x, it = _refine(b)
    return x * 1.0, it


def _refine(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x, it = cg(b)  # the loop: in ``cg``, a module-level function
    return x, it


class LinearSolve(torch.autograd.Function):
    """An implicit solve whose forward and backward call a module-level CG."""

    @staticmethod
    def forward(ctx: Any, b: torch.Tensor) -> torch.Tensor:
        x, _ = cg(b)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return cg(grad)[0]  # the operator is symmetric


def _solve_step(v: torch.Tensor) -> torch.Tensor:
    return LinearSolve.apply(v * 2)  # type: ignore[no-any-return]


def test_a_loop_in_a_called_function_is_captured_two_calls_down() -> None:
    captured = _captured(_solve_twice)
    (loop,) = captured.loops
    assert loop.owner == "cg" and "cg line" in captured.describe()
    b = _rhs(12, 3)
    x, it = captured.function(b)
    x_eager, it_eager = _solve_twice(b)
    assert torch.equal(x, x_eager) and int(it) == int(it_eager) > 4
    assert loop.blocks_run == -(-int(it_eager) // 4)  # one host check per block of 4


def test_a_called_function_rebound_later_is_called_as_it_is_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    captured = _captured(_refine)
    b = _rhs(8, 1)
    captured.function(b)
    runs = captured.loops[0].blocks_run
    monkeypatch.setitem(globals(), "cg", lambda b: (b * 3, torch.tensor(0)))
    x, it = captured.function(b)  # the new cg, as the original code would call it
    assert torch.equal(x, b * 3) and int(it) == 0 and captured.loops[0].blocks_run == runs


def test_a_called_function_with_a_side_effect_in_its_loop_is_not_captured() -> None:
    def noisy(b: torch.Tensor) -> torch.Tensor:
        while bool(b.abs().max() > 1):
            b = b / 2
            print("halved")
        return b

    def forward(b: torch.Tensor) -> torch.Tensor:
        return noisy(b) + 1

    result = capture_loops(forward, "forward", None)
    assert isinstance(result, str) and "in noisy, line" in result and "print" in result


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.uses_torchscript  # engine "compile": TorchScript compiles its custom-function bodies
def test_a_jitted_autograd_function_whose_solver_is_a_called_function_is_looped(
    backend: str,
) -> None:
    jitted = _like_eager_with_gradients(_solve_step, backend, 10)
    assert "forward: looped" in jitted.explain() and "cg line" in jitted.explain()


# -- loops in backward functions --------------------------------------------------------------


class ImplicitSolve(LinearSolve):
    """``LinearSolve`` with the adjoint CG loop written in ``backward`` itself, as users do."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        x = torch.zeros_like(grad)  # the adjoint solve, inline (A is symmetric)
        r = grad.clone()
        d = r.clone()
        rs = (r * r).sum()
        it = 0
        while bool(rs > 1e-20 * (grad * grad).sum() + 1e-30) and it < 300:
            ad = laplace(d)
            alpha = rs / (d * ad).sum()
            x = x + alpha * d
            r = r - alpha * ad
            rs, rs_old = (r * r).sum(), rs
            d = r + rs / rs_old * d
            it += 1
        return x


def _implicit_step(v: torch.Tensor) -> torch.Tensor:
    return ImplicitSolve.apply(v.sin())  # type: ignore[no-any-return]


def _adjoint(inputs: Any, outputs: Any, grads: Any) -> tuple[torch.Tensor]:
    x, _ = cg(grads[0])  # a def gradient whose loop is in the function it calls
    return (x,)


def _forward_cg(b: torch.Tensor) -> torch.Tensor:
    return cg(b)[0]


solve_with_adjoint = ptj.custom_gradient(_forward_cg, _adjoint, name="solve_with_adjoint")


def _adjoint_step(v: torch.Tensor) -> torch.Tensor:
    return solve_with_adjoint(v * 3)


@pytest.mark.parametrize("step", [_implicit_step, _adjoint_step], ids=["Function", "custom"])
@pytest.mark.uses_torchscript  # engine "compile": TorchScript compiles its custom-function bodies
def test_a_loop_in_a_backward_is_captured_and_its_gradients_equal_eager(step: Any) -> None:
    jitted = ptj.jit(step, engine="compile", backend="aot_eager", fallback="off")
    for seed in range(3):
        v = _rhs(10, seed).requires_grad_(True)
        v_eager = v.detach().clone().requires_grad_(True)
        out, out_eager = jitted(v), step(v_eager)
        torch.testing.assert_close(out, out_eager, rtol=1e-6, atol=1e-9)
        (out * out_eager.detach().cos()).sum().backward()
        (out_eager * out_eager.detach().cos()).sum().backward()
        torch.testing.assert_close(v.grad, v_eager.grad, rtol=1e-6, atol=1e-9)
    assert jitted.num_traces == 1
    (call,) = jitted.specializations[0].calls
    (backward,) = call.backward.specializations.values()
    assert backward.mode == "looped", backward
    assert backward.compiled is not None and "captured" in backward.compiled.reason


def test_a_python_truth_joins_the_loops_tensors_on_their_device() -> None:
    """A condition that mixes a Python value with the loop's tensors (``while bool(rs > tol)
    and it < 500``) is made on their device: a CPU truth beside CUDA ones raised inside the
    compiled program on CUDA, and the whole step ran eagerly (make test-cuda)."""
    from phi_torch_jit._loops._block import _and, _or, _stay, _truth

    on_meta = torch.zeros((), dtype=torch.bool, device="meta")
    assert _truth(True, on_meta).device.type == "meta"
    assert _truth(torch.tensor(2), on_meta).device.type == "meta"
    assert _truth(True).device == torch.get_default_device()
    for truth in (_stay(True, on_meta), _and(True, on_meta), _or(on_meta, False)):
        assert truth.device.type == "meta" and truth.dtype == torch.bool


def test_a_block_is_built_from_one_traced_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    """The block's K iterations are copies of one traced iteration: the body's Python runs
    once to build a block of 4 (it ran 4 times: 0.2 s of a PhiFlow step's 1.3 s first call),
    and the values equal the Python loop's exactly."""
    calls = Counter()
    plain = laplace

    def counted(d: torch.Tensor) -> torch.Tensor:
        calls.forward += 1
        return plain(d)

    monkeypatch.setitem(globals(), "laplace", counted)  # cg's body calls it by name
    captured = _captured(cg, block=4)
    b = _rhs()
    x, it = captured.function(b)
    assert calls.forward == 1 and captured.loops[0].blocks_run > 1
    calls.forward = 0
    expected_x, expected_it = cg(b)
    assert torch.equal(x, expected_x) and int(it) == int(expected_it) == calls.forward


def test_an_iteration_that_changes_its_carried_layout_is_traced_block_long() -> None:
    """Where one iteration's outputs do not look like its inputs (here a transpose changes the
    strides), copies of it would carry the wrong metadata: the K iterations are traced."""
    calls = Counter()

    def turned(m: torch.Tensor) -> torch.Tensor:
        calls.forward += 1
        return (m * 0.5).t()

    def halving(m: torch.Tensor) -> torch.Tensor:
        while bool(m.abs().max() > 1e-3):
            m = turned(m)
        return m

    captured = _captured(halving, block=4)
    m = torch.arange(12.0).reshape(3, 4)[:, :3]
    result = captured.function(m)
    assert calls.forward == 1 + 4  # traced once, found to change its layout, then 4 times
    assert captured.loops[0].blocks_run > 1 and torch.equal(result, halving(m))


def halve_until(x: torch.Tensor, stop: float) -> torch.Tensor:
    while bool(x.abs().max() > stop):
        x = x / 2
    return x


def test_a_loop_that_ended_in_its_first_block_runs_one_iteration_first() -> None:
    """A warm-started solve (a simulation's pressure solve from the last step's pressure) often
    converges in one iteration, and a block of K computed K (NOTE [a short first block] in
    docs/loops.md). Once a run ended in its first block, a block of one iteration runs first,
    built once; a run it does not end goes on in blocks of K and the next runs skip it for a
    while (no measuring: the loop's own exits decide). Values equal the Python loop's."""
    from phi_torch_jit._loops._block import SHORT_BACKOFF

    built: list[int] = []

    def compile_graph(graph: torch.fx.GraphModule, inputs: Any) -> torch.fx.GraphModule:
        built.append(len(inputs))
        return graph

    captured = capture_loops(halve_until, "halve_until", compile_graph, block=4)
    assert isinstance(captured, Captured), captured
    (loop,) = captured.loops

    def run(scale: float) -> int:  # blocks run for x = 1.5 * scale: log2(1.5 scale) halvings
        before = loop.blocks_run
        x = torch.full((3,), 1.5 * scale, dtype=torch.float64)
        assert torch.equal(captured.function(x, 1.0), halve_until(x, 1.0))
        return loop.blocks_run - before

    assert run(4.0) == 1 and len(built) == 1 and not loop.short  # 3 iterations: one block
    assert run(1.0) == 1 and len(built) == 2 and len(loop.short) == 1  # 1: the short block
    assert run(1.0) == 1 and len(built) == 2  # built once
    assert run(64.0) == 1 + 2  # 7 iterations: the short block, then two of 4
    for _ in range(SHORT_BACKOFF):
        assert run(1.0) == 1  # skipped: the block of 4 ends it
    assert run(1.0) == 1 and loop._short_skips[next(iter(loop.short))] == 0  # tried again
    assert run(0.5) == 0 and len(built) == 2  # at rest: no block at all


def test_a_loop_that_never_ends_in_its_first_block_builds_no_short_block() -> None:
    captured = _captured(cg, block=4)
    (loop,) = captured.loops
    blocks = 0
    for seed in range(3):
        b = _rhs(seed=seed)
        x, it = captured.function(b)
        x_eager, it_eager = cg(b)
        assert torch.equal(x, x_eager) and int(it) == int(it_eager) > 4
        blocks += -(-int(it) // 4)
    assert not loop.short and len(loop.programs) == 1 and loop.blocks_run == blocks
