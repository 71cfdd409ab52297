"""Plain torch.autograd.Function subclasses inside jit, unchanged (issue 3, section 1)."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import pytest
import torch
from helpers import Counter, cg_loop, engine_name, gradcheck, laplace, value_loop_mode
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

import phi_torch_jit as ptj
from phi_torch_jit._function import interception_installed

pytestmark = pytest.mark.all_engines

COUNT = Counter()


class ScaledSquare(torch.autograd.Function):
    """Old style: forward(ctx, ...), tensor and non-tensor ctx attributes, needs_input_grad."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
        COUNT.forward += 1
        ctx.save_for_backward(x, w)
        ctx.scale = scale
        ctx.twice = 2 * x  # a tensor attribute: a residual
        return scale * x * x * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        COUNT.gradient += 1
        x, w = ctx.saved_tensors
        gx = g * ctx.scale * ctx.twice * w if ctx.needs_input_grad[0] else None
        gw = g * ctx.scale * x * x if ctx.needs_input_grad[1] else None
        return gx, gw, None


class SplitNewStyle(torch.autograd.Function):
    """New style: forward + setup_context; several outputs, one non-differentiable."""

    @staticmethod
    def forward(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return x * k, torch.argmax(x, dim=-1)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        _, k = inputs
        ctx.k = k
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor, _g_index: Any) -> tuple[Any, ...]:
        return g * ctx.k, None, None  # one more entry than inputs: a trailing None


class CGSolve(torch.autograd.Function):
    """A data-dependent loop in forward and backward; tol is a static float argument."""

    @staticmethod
    def forward(ctx: Any, b: torch.Tensor, k: torch.Tensor, tol: float | None) -> torch.Tensor:
        x = cg_loop(b, k)
        ctx.save_for_backward(x, k)
        ctx.tol = tol
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        x, k = ctx.saved_tensors
        lam = cg_loop(g, k)
        return lam, (lam * laplace(x)).sum().reshape(k.shape), None


class InPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 2


@pytest.mark.torchscript_bodies
def test_old_style_function_compiled_with_eager_results() -> None:
    COUNT.__init__()  # type: ignore[misc]

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return ScaledSquare.apply(x, w, 1.5).sin()

    step = ptj.jit(f, fallback="off")  # counts the compiled path (the meter runs eager code)
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    step(x, w)
    forwards = COUNT.forward
    for _ in range(3):
        assert torch.allclose(step(x, w), f(x, w))
        got = torch.autograd.grad(step(x, w).sum(), [x, w])
        want = torch.autograd.grad(f(x, w).sum(), [x, w])
        assert all(torch.allclose(a, b) for a, b in zip(got, want))
    assert COUNT.forward == forwards + 6  # only the eager reference calls ran Python
    (call,) = step.specializations[0].calls
    assert call.forward.mode == "traced" and call.op_name.startswith("ScaledSquare_")
    assert call.backward.specializations[(True, True)].mode == "traced"
    assert gradcheck(step, (x, w))


def test_backward_pattern_changes_reach_needs_input_grad(jit_engine: str) -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.rand(4) + 0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return ScaledSquare.apply(x, self.w, 2.0)

    module = Scale()
    step = ptj.jit(module)
    x = torch.randn(4, requires_grad=True)
    module.w.requires_grad_(False)
    step(x).sum().backward()
    step(x).sum().backward()
    module.w.requires_grad_(True)
    x.grad = None
    step(x).sum().backward()
    assert module.w.grad is not None and torch.allclose(module.w.grad, 2 * x.detach() ** 2)
    assert torch.allclose(x.grad, 2 * 2 * x.detach() * module.w.detach())
    if engine_name(jit_engine) == "compile":  # its program fixed which parameters get
        assert step.num_traces == 2  # gradients: a requires_grad change retraces
        return
    assert step.num_traces == 1
    (call,) = step.specializations[0].calls
    assert set(call.backward.specializations) == {(True, False), (True, True)}


def test_new_style_setup_context_non_differentiable_and_materialize() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, index = SplitNewStyle.apply(x, 3)
        return y.sum(dim=-1), index

    step = ptj.jit(f)
    x = torch.randn(2, 6, requires_grad=True)
    step(x)
    y, index = step(x)
    want_y, want_index = f(x)
    assert torch.allclose(y, want_y) and torch.equal(index, want_index)
    assert not index.requires_grad and y.requires_grad  # as in eager
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    spec = step.specializations[0]
    assert not spec.eager_reason and spec.calls[0].op_name.startswith("SplitNewStyle_")


def test_data_dependent_loop_is_not_baked_and_static_tol_is_fine() -> None:
    step = ptj.jit(lambda b, k: CGSolve.apply(b, k, 1e-8))
    b = torch.randn(12, dtype=torch.float64, requires_grad=True)
    k = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
    step(b, k)
    spec = step.specializations[0]
    assert not spec.eager_reason
    (call,) = spec.calls
    assert call.forward.mode == value_loop_mode(step)
    assert torch.equal(step(torch.zeros_like(b), k), torch.zeros_like(b))
    assert gradcheck(step, (b, k))


def test_keyword_and_none_arguments() -> None:
    step = ptj.jit(lambda b, k: CGSolve.apply(b, k=k, tol=None))
    b, k = torch.randn(6), torch.tensor(0.2)
    step(b, k)
    assert torch.allclose(step(b, k), cg_loop(b, k))


def test_in_place_function_runs_eagerly_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    step = ptj.jit(lambda x: InPlace.apply(x.clone()) + 1)
    x = torch.randn(3, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="phi_torch_jit"):
        with pytest.warns(ptj.JitWarning, match="ctx.mark_dirty") as warned:
            for _ in range(3):
                out = step(x)
    assert len(warned) == 1
    assert torch.allclose(out, 2 * x + 1)
    out.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    logs = [r.getMessage() for r in caplog.records]
    assert len(logs) == 1 and "ctx.mark_dirty" in logs[0]
    assert "runs eagerly" in step.explain()


def test_reentrant_checkpoint_works_unchanged() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))

    def f(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(net, x, use_reentrant=True).pow(2).sum()

    x = torch.randn(3, 4, requires_grad=True)
    f(x).backward()
    want_w, want_x = net[0].weight.grad.clone(), x.grad.clone()
    step = ptj.jit(f)
    for _ in range(3):
        net.zero_grad()
        x.grad = None
        step(x).backward()
        assert torch.allclose(net[0].weight.grad, want_w) and torch.allclose(x.grad, want_x)
    assert not step.specializations[0].eager_reason


def test_functions_outside_jit_are_untouched() -> None:
    assert not interception_installed()
    x = torch.randn(3, requires_grad=True)
    ScaledSquare.apply(x, torch.ones(3), 1.0).sum().backward()
    assert torch.allclose(x.grad, 2 * x.detach())


def test_ode_adjoint_from_a_library_works_unchanged() -> None:
    torchdiffeq = pytest.importorskip("torchdiffeq")

    class Dynamics(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2, dtype=torch.float64)

        def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.lin(y))

    dynamics = Dynamics()

    def final_sum(y0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        ys = torchdiffeq.odeint_adjoint(dynamics, y0, t, rtol=1e-8, atol=1e-8)
        return ys[-1].sum()

    y0 = torch.randn(2, dtype=torch.float64, requires_grad=True)
    t = torch.linspace(0, 1, 3, dtype=torch.float64)
    final_sum(y0, t).backward()
    want_y, want_w = y0.grad.clone(), dynamics.lin.weight.grad.clone()
    step = ptj.jit(final_sum)
    with pytest.warns(ptj.JitWarning, match="new _PerturbFunc object on every call") as warned:
        for _ in range(2):
            y0.grad = None
            dynamics.zero_grad()
            step(y0, t).backward()
            assert torch.allclose(y0.grad, want_y)
    assert len(warned) == 1
    for _ in range(2):
        y0.grad = None
        dynamics.zero_grad()
        step(y0, t).backward()
        assert torch.allclose(y0.grad, want_y) and torch.allclose(dynamics.lin.weight.grad, want_w)


class SavesDependingOnValue(torch.autograd.Function):
    """A Python-mode forward whose ctx contents depend on tensor values, per call."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = cg_loop(x, torch.tensor(0.0))  # a data-dependent loop: runs as Python (k=0: y = x)
        positive = bool(x.sum() > 0)
        ctx.save_for_backward(x if positive else None)
        ctx.factor = 3.0 if positive else 1.0  # a per-call Python value
        return y * ctx.factor

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        assert (x is not None) == (ctx.factor == 3.0)
        return g * ctx.factor


def test_per_call_ctx_contents_reach_their_own_backward() -> None:
    step = ptj.jit(lambda x: SavesDependingOnValue.apply(x) * 2)
    step(torch.ones(3))
    xs = [torch.full((3,), v, requires_grad=True) for v in (1.0, -1.0, 2.0, -3.0)]
    if step.engine.captures_graph:  # a graph's backward op gets the compiled call's ctx
        with pytest.raises(ptj.TraceError, match="left other values on its ctx"):
            [step(x) for x in xs]
        return
    outs = [step(x) for x in xs]  # several forwards before any backward
    torch.stack(outs).sum().backward()
    for x in xs:
        factor = 3.0 if x.sum() > 0 else 1.0
        assert torch.equal(x.grad, torch.full((3,), 2 * factor))
    assert not step.specializations[0].eager_reason


def test_a_function_saving_for_forward_mode_runs_eagerly_naming_it() -> None:
    """``ctx.save_for_forward`` (a ``jvp`` formula) is not compiled: one warning names it, and
    values, gradients and forward-mode tangents are eager's."""

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(x: torch.Tensor) -> torch.Tensor:
            return x * x

        @staticmethod
        def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            ctx.save_for_backward(inputs[0])
            ctx.save_for_forward(inputs[0])

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            (x,) = ctx.saved_tensors
            return 2 * x * g

        @staticmethod
        def jvp(ctx: Any, t: torch.Tensor) -> torch.Tensor:
            (x,) = ctx.saved_tensors
            return 2 * x * t

    def f(x: torch.Tensor) -> torch.Tensor:
        return Square.apply(x).sin()

    jitted = ptj.jit(f)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            x = torch.randn(3, requires_grad=True)
            y = jitted(x)
            torch.testing.assert_close(y, f(x))
            (g,) = torch.autograd.grad(y.sum(), x)
            torch.testing.assert_close(g, 2 * x.detach() * torch.cos(x.detach() ** 2))
    said = [str(w.message) for w in caught if issubclass(w.category, ptj.JitWarning)]
    assert len(said) == 1 and "ctx.save_for_forward" in said[0]
    from conftest import NO_TORCHSCRIPT

    if NO_TORCHSCRIPT:
        return  # torch's forward-mode AD scripts its own jvp rules at its first dual tensor
    import torch.autograd.forward_ad as fw

    x = torch.randn(3)
    with fw.dual_level(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch scripts its jvp rules once
        warnings.simplefilter("ignore", FutureWarning)  # (torch 2.15 says so as a FutureWarning)
        tangent = fw.unpack_dual(jitted(fw.make_dual(x, torch.ones(3)))).tangent
    torch.testing.assert_close(tangent, 2 * x * torch.cos(x**2))


class StraightThrough(torch.autograd.Function):
    """A rounding whose backward is not its forward's derivative (a straight-through
    estimator): a program that differentiated the forward's ops would give zeros."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return 2.0 * g


straight_through = StraightThrough.apply  # bound at import, before jit's interception


class _Quantized(nn.Module):
    def __init__(self, op: Any = StraightThrough.apply) -> None:
        super().__init__()
        self.op = op  # an alias held by a module, as libraries hold their ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.op(x) * x).sum()


def _aliased(x: torch.Tensor) -> torch.Tensor:
    return (straight_through(x) * x).sum()


@pytest.mark.parametrize("holder", ["global", "module attribute"])
def test_a_function_applied_through_an_alias_runs_eagerly_with_its_own_backward(
    jit_engine: str, holder: str
) -> None:
    """``op = F.apply`` bound at import calls torch's apply directly, past the interception:
    the program differentiated the forward's ops (a zero gradient through ``round``) from the
    second call on, silently (found by a probe). The record pass sees every backward node a
    Function builds; an apply it did not intercept makes the step run eagerly, warned, with the
    Function's own backward. ``F.apply`` called in the step compiles as before."""
    step = _aliased if holder == "global" else _Quantized()
    jitted = ptj.jit(step)
    caught = []
    for i in range(3):
        x0 = torch.tensor([0.3, 1.7, -2.2], dtype=torch.float64) * (i + 1)
        x, y = x0.clone().requires_grad_(True), x0.clone().requires_grad_(True)
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always", ptj.JitWarning)
            got = jitted(x)
        caught += [str(w.message) for w in warned]
        want = step(y)
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(x.grad, y.grad)
    assert any("StraightThrough" in w and "bound before the call" in w for w in caught), caught
    assert "runs eagerly" in jitted.explain()

    def direct(x: torch.Tensor) -> torch.Tensor:
        return (StraightThrough.apply(x) * x).sum()

    compiled = ptj.jit(direct)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for _ in range(2):
            x = torch.tensor([0.3, 1.7], dtype=torch.float64, requires_grad=True)
            compiled(x).backward()
            assert x.grad is not None
            torch.testing.assert_close(x.grad, x.detach().round() + 2.0 * x.detach())
    assert "runs eagerly" not in compiled.explain()


class TwoOutputsUnmaterialized(torch.autograd.Function):
    """``set_materialize_grads(False)`` and two differentiable outputs: eager gives backward
    None for an output that got no gradient, which the backward skips."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x)
        return x**3, torch.log(x.abs())

    @staticmethod
    def backward(ctx: Any, g1: Any, g2: Any) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        result = g1 * 3 * x**2
        return result if g2 is None else result + g2 / x


def test_unmaterialized_gradients_of_several_outputs_run_eagerly(jit_engine: str) -> None:
    """A compiled backward gets zeros where eager gives None: ``0 / x`` at ``x = 0`` was NaN
    in every call, the record pass's too (found by a probe). Such a Function runs eagerly,
    warned; one differentiable output (``SplitNewStyle``) compiles, its marked output's
    gradient None as in eager."""

    def step(x: torch.Tensor) -> torch.Tensor:
        cube, _ = TwoOutputsUnmaterialized.apply(x)
        return cube.sum()

    jitted = ptj.jit(step)
    for i in range(3):
        x0 = torch.tensor([0.0, 1.0, -2.0], dtype=torch.float64) * (i + 1)
        x, y = x0.clone().requires_grad_(True), x0.clone().requires_grad_(True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ptj.JitWarning)
            jitted(x).backward()
        step(y).backward()
        torch.testing.assert_close(x.grad, y.grad)
        assert i > 0 or any("set_materialize_grads" in str(w.message) for w in caught)
    assert "runs eagerly" in jitted.explain()


class GraphInForward(torch.autograd.Function):
    """A forward that builds a graph under ``enable_grad`` and keeps it for its backward (an
    implicit layer differentiating its own residual): a compiled op's outputs carry no graph,
    and the first call raised "appears to not have been used in the graph"."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            leaf = x.detach().requires_grad_(True)
            y = leaf.sin() * leaf
        ctx.save_for_backward(leaf, y)
        return y.detach()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        leaf, y = ctx.saved_tensors
        (gx,) = torch.autograd.grad(y, leaf, g)
        return gx


class VmappedSine(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.sin()

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g * x.cos()


@pytest.mark.parametrize("case", ["graph kept by the forward", "under vmap"])
def test_functions_the_stand_in_cannot_run_run_eagerly_instead_of_raising(
    jit_engine: str, case: str
) -> None:
    """Two Functions that raised under jit and not in eager (found by a probe): a forward
    keeping an autograd graph for its backward, and a new-style Function under ``torch.vmap``
    (our stand-in has no setup_context, no vmap rule). Both run eagerly, warned."""
    if case == "under vmap":

        def step(x: torch.Tensor) -> torch.Tensor:
            return torch.vmap(VmappedSine.apply)(x).sum(-1)

    else:

        def step(x: torch.Tensor) -> torch.Tensor:
            return GraphInForward.apply(x)

    jitted = ptj.jit(step)
    for i in range(3):
        x0 = torch.linspace(0.1, 1.0, 6, dtype=torch.float64).reshape(2, 3) * (i + 1)
        x, y = x0.clone().requires_grad_(True), x0.clone().requires_grad_(True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ptj.JitWarning)
            got = jitted(x)
        want = step(y)
        torch.testing.assert_close(got, want)
        got.sum().backward()
        want.sum().backward()
        torch.testing.assert_close(x.grad, y.grad)
    assert "runs eagerly" in jitted.explain()


def test_an_alias_under_no_grad_compiles() -> None:
    """No backward can run through an aliased apply under ``no_grad`` (inference with a
    library holding an alias): no reason to run eagerly; the grad mode is in the key."""
    jitted = ptj.jit(_aliased)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for i in range(3):
            x = torch.tensor([0.3, 1.7, -2.2], dtype=torch.float64) * (i + 1)
            torch.testing.assert_close(jitted(x), _aliased(x))
    assert "runs eagerly" not in jitted.explain()


_CALLS = torch.zeros(1)


class _CountsCalls(torch.autograd.Function):
    """Counts its calls in a global tensor (a side effect of its forward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        _CALLS.add_(1)
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 2


class _CountsInto(torch.autograd.Function):
    """The same, writing a tensor it is given (``ctx.mark_dirty`` not needed: not an output)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, calls: torch.Tensor) -> torch.Tensor:
        calls.add_(1)
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g * 2, None


def test_a_forward_writing_a_tensor_it_is_not_given_runs_eagerly_once_per_call() -> None:
    """Its compiled forward would not repeat the write (a captured graph dropped it: the count
    stayed 2; the compile step ran it once more: 3, 4, 5...); eager, warned, it counts as
    eager does (probe round 13). Given the tensor, the step compiles and counts right."""
    _CALLS.zero_()
    jitted = ptj.jit(lambda x: _CountsCalls.apply(x))
    with pytest.warns(ptj.JitWarning, match="writes a tensor in place that it is not given"):
        jitted(torch.ones(2))
    for calls in range(2, 6):
        torch.testing.assert_close(jitted(torch.ones(2) * calls), torch.ones(2) * calls * 2)
        assert _CALLS.item() == calls
    counted = torch.zeros(1)
    given = ptj.jit(lambda x: _CountsInto.apply(x, counted))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for calls in range(1, 5):
            given(torch.ones(2))
            assert counted.item() == calls
    assert not given.specializations[0].eager_reason


class _AddsThroughData(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        total.data.add_(x)  # its input, through an alias a captured graph does not follow
        return x * 1

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


class _AddsDirty(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        total.add_(x)
        ctx.mark_dirty(total)
        return total

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return g, g


@pytest.mark.parametrize("function", [_AddsThroughData, _AddsDirty], ids=lambda f: f.__name__)
def test_a_forward_writing_its_input_through_data_or_marked_dirty_writes_once(
    function: Any,
) -> None:
    """Engine "compile"'s captured forward dropped a write through ``.data`` (the total
    stayed 1); a ``mark_dirty`` Function wrote its input twice on the first call (the
    capture ran its forward before refusing it). Both run eagerly, each write once."""
    total = torch.zeros(2)
    jitted = ptj.jit(lambda x, t: function.apply(x, t) * 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ptj.JitWarning)
        for calls in range(1, 5):
            jitted(torch.ones(2), total)
            torch.testing.assert_close(total, torch.full((2,), float(calls)))
