"""Stage 2 (trace): torch.autograd.grad inside the step, captured as ops (_inner_grad).

Engines that capture a graph (compile, auto) compile forces, PINN residuals and Hamiltonian
flows; the training loss differentiates the captured gradient again, equal to eager. Engine
torchscript runs them eagerly with one warning. Refused captures run eagerly with one warning
naming why (backward() inside, a random or in-place op on the gradient's way).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import Counter, captures_graph, gradcheck, gradgradcheck, seeded
from torch import nn
from torch.autograd import grad as imported_grad
from torch.autograd.function import once_differentiable

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines


def _warnings_of(call: Callable[..., Any], *args: Any) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call(*args)
    return result, [str(w.message) for w in caught if issubclass(w.category, ptj.JitWarning)]


def _compiled(jitted: Any) -> bool:
    return "runs eagerly" not in jitted.explain()


def _like_eager(got: torch.Tensor, want: torch.Tensor, module: nn.Module) -> None:
    """The jitted step's value and the gradients of ``module``'s parameters equal eager's."""
    torch.testing.assert_close(got, want)
    parameters = list(module.parameters())
    for a, b in zip(torch.autograd.grad(got, parameters), torch.autograd.grad(want, parameters)):
        torch.testing.assert_close(a, b)


def _potential() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def _energy_and_forces(potential: nn.Module, grad: Callable[..., Any]) -> Callable[..., Any]:
    def loss(pos: torch.Tensor, energy: torch.Tensor, forces: torch.Tensor) -> torch.Tensor:
        pos = pos.detach().requires_grad_(True)
        e = potential(pos).sum()
        (g,) = grad(e, pos, create_graph=True)
        return (e - energy) ** 2 + ((-g - forces) ** 2).mean()

    return loss


def _train(step: Callable[..., Any], potential: nn.Module, batches: list[Any]) -> list[Any]:
    optimizer = torch.optim.Adam(potential.parameters(), lr=1e-2)
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = step(*batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return [*losses, *[p.detach().clone() for p in potential.parameters()]]


def _batches(n: int) -> list[tuple[torch.Tensor, ...]]:
    g = seeded(1)
    return [
        (torch.randn(6, 3, generator=g, dtype=torch.float64),
         torch.randn((), generator=g, dtype=torch.float64),
         torch.randn(6, 3, generator=g, dtype=torch.float64))
        for _ in range(n)
    ]  # fmt: skip


@pytest.mark.parametrize("grad", [torch.autograd.grad, imported_grad], ids=["attribute", "import"])
def test_a_potential_trained_on_energies_and_forces_equals_eager(
    jit_engine: str, grad: Callable[..., Any]
) -> None:
    torch.manual_seed(0)
    eager_model = _potential()
    jit_model = _potential()
    jit_model.load_state_dict(eager_model.state_dict())
    want = _train(_energy_and_forces(eager_model, grad), eager_model, _batches(5))
    jitted = ptj.jit(_energy_and_forces(jit_model, grad))
    got, said = _warnings_of(lambda: _train(jitted, jit_model, _batches(5)))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert jitted.num_traces == 1
    if captures_graph(jit_engine):
        assert said == [] and _compiled(jitted)
    else:
        assert len(said) == 1 and "torch.autograd.grad" in said[0]


def _pinn(net: nn.Module) -> Callable[..., Any]:
    """The residual of viscous Burgers u_t + u u_x - nu u_xx on collocation points."""

    def residual_loss(xt: torch.Tensor, nu: torch.Tensor) -> torch.Tensor:
        xt = xt.detach().requires_grad_(True)
        u = net(xt)
        (du,) = torch.autograd.grad(u.sum(), xt, create_graph=True)
        u_x, u_t = du[:, :1], du[:, 1:]
        (ddu,) = torch.autograd.grad(u_x.sum(), xt, create_graph=True)
        u_xx = ddu[:, :1]
        return ((u_t + u * u_x - nu * u_xx) ** 2).mean()

    return residual_loss


def test_a_pinn_residual_with_second_derivatives_trains_like_eager(jit_engine: str) -> None:
    torch.manual_seed(0)

    def make() -> nn.Module:
        layers = [nn.Linear(2, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 1)]
        return nn.Sequential(*layers).double()

    eager_net, jit_net = make(), make()
    jit_net.load_state_dict(eager_net.state_dict())
    g = seeded(2)
    batches = [(torch.rand(16, 2, generator=g, dtype=torch.float64),
                torch.tensor(0.01, dtype=torch.float64)) for _ in range(4)]  # fmt: skip
    want = _train(_pinn(eager_net), eager_net, batches)
    jitted = ptj.jit(_pinn(jit_net))
    got, said = _warnings_of(lambda: _train(jitted, jit_net, batches))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert jitted.num_traces == 1
    assert (said == [] and _compiled(jitted)) if captures_graph(jit_engine) else len(said) == 1


def test_a_hamiltonian_flow_integrated_inside_the_step_equals_eager(jit_engine: str) -> None:
    torch.manual_seed(0)
    hamiltonian = nn.Sequential(nn.Linear(2, 16), nn.Softplus(), nn.Linear(16, 1)).double()

    def flow(q: torch.Tensor, p: torch.Tensor, dt: float = 0.05) -> torch.Tensor:
        for _ in range(4):  # symplectic Euler on dH/dq, dH/dp
            qp = torch.stack([q, p], -1).requires_grad_(True)
            (dh,) = torch.autograd.grad(hamiltonian(qp).sum(), qp, create_graph=True)
            p = p - dt * dh[..., 0]
            q = q + dt * dh[..., 1]
        return (q**2).sum() + (p**2).sum()

    jitted = ptj.jit(flow)
    for seed in range(3):
        g = seeded(seed)
        q, p = (torch.randn(5, generator=g, dtype=torch.float64) for _ in range(2))
        got, _ = _warnings_of(jitted, q, p)
        want = flow(q, p)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        params = list(hamiltonian.parameters())[:-1]  # the last bias does not reach dH
        for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(want, params)):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert jitted.num_traces == 1
    assert _compiled(jitted) == captures_graph(jit_engine)


def test_gradgradcheck_through_a_step_with_forces(jit_engine: str) -> None:
    torch.manual_seed(0)
    w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)

    def forces(pos: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        pos = pos.detach().requires_grad_(True)
        energy = torch.tanh(pos @ w).sum()
        (g,) = torch.autograd.grad(energy, pos, create_graph=True)
        return -g

    jitted = ptj.jit(forces)
    pos = torch.randn(5, 3, dtype=torch.float64)
    assert _warnings_of(lambda: gradcheck(lambda w: jitted(pos, w), (w,)))[0]
    assert gradgradcheck(lambda w: jitted(pos, w), (w,))
    assert jitted.num_traces == 1
    assert _compiled(jitted) == captures_graph(jit_engine)


@pytest.mark.parametrize("made", ["from_an_input", "under_no_grad"])
def test_a_constant_the_step_released_before_the_gradient_is_computed_again(
    jit_engine: str, made: str
) -> None:
    """``(w * 2).reshape(...)`` is added (``add`` saves nothing for its backward) and released
    before ``autograd.grad`` runs, as inside a library's layer (e3nn's tensor products): the
    captured gradient computes it again instead of running the step eagerly. Made under
    ``no_grad`` from values that need a gradient, it stays a constant when computed again (the
    parameters' gradients were wrong before it was detached)."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).double()

    def offset(w: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(made != "under_no_grad"):
            return (w * 2).reshape(2, 3)

    def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_(True)
        h = lin(x)
        source = w if made == "from_an_input" else h.sin().reshape(6)
        energy = torch.tanh(h + offset(source)).sum()
        (g,) = torch.autograd.grad(energy, x, create_graph=True)
        return g.square().sum()

    jitted = ptj.jit(step)
    for _ in range(3):
        x, w = torch.randn(2, 3, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
        (got, caught) = _warnings_of(jitted, x, w)
        assert not caught or not captures_graph(jit_engine)  # torchscript: eager, warned
        _like_eager(got, step(x, w), lin)
    assert jitted.num_traces == 1
    assert _compiled(jitted) == captures_graph(jit_engine)


class SoftStep(torch.autograd.Function):
    """e3nn's smooth cutoff step as its ``_SoftUnitStep`` writes it: masked ops in forward and
    backward (sizes that depend on values), a backward made of differentiable ops."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        y = torch.zeros_like(x)
        m = x > 0
        y[m] = (-1 / x[m]).exp()
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        CALLS.gradient += 1
        dx = torch.zeros_like(x)
        m = x > 0
        xm = x[m]
        dx[m] = (-1 / xm).exp() / xm.pow(2)
        return dx * dy


class _Sine(torch.autograd.Function):
    """``sin``, its input saved; subclasses give the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.sin()


class BranchingBackward(_Sine):
    """A backward whose Python branches on a tensor value."""

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g * x.cos() if x.sum() > 0 else 2 * g * x.cos()  # wrong on purpose: which ran


CALLS = Counter()


def _through(function: Any, lin: nn.Module) -> Callable[..., Any]:
    def step(x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(function.apply(lin(x)).sum(), x, create_graph=True)
        return g.square().sum()

    return step


def test_a_gradient_through_a_custom_function_runs_its_own_backward_as_ops(
    jit_engine: str,
) -> None:
    """Forces through a custom function (e3nn's cutoff in its radial embeddings): the gradient
    is the function's own backward traced as ops, which the training loss differentiates again,
    as eager's double backward does. Masks select another number of entries on every call."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).double()
    step = _through(SoftStep, lin)
    jitted = ptj.jit(step)
    g = seeded(2)
    python_backwards = []
    for i in range(5):
        x = torch.randn(5, 3, generator=g, dtype=torch.float64) + (i - 2) * 0.4
        before = CALLS.gradient
        got, caught = _warnings_of(jitted, x)
        python_backwards.append(CALLS.gradient - before)
        assert not caught or not captures_graph(jit_engine)  # torchscript: eager, warned
        _like_eager(got, step(x), lin)
    assert jitted.num_traces == 1
    assert _compiled(jitted) == captures_graph(jit_engine)
    if captures_graph(jit_engine):  # the backward's Python ran while compiling only
        assert python_backwards[0] > 0 and python_backwards[1:] == [0] * 4
    w = torch.randn(3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True)

    def forces(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.autograd.grad(SoftStep.apply(x @ w).sum(), x, create_graph=True)[0]

    through = ptj.jit(forces)
    assert _warnings_of(lambda: gradcheck(lambda w: through(x, w), (w,)))[0]
    assert gradgradcheck(lambda w: through(x, w), (w,))
    assert _compiled(through) == captures_graph(jit_engine)


class NoGradInBackward(_Sine):
    """A backward computing its derivative under ``no_grad``: eager's double backward takes it
    as a constant."""

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        with torch.no_grad():
            c = x.cos()
        return c * g


class OnceDifferentiable(NoGradInBackward):
    """The same derivative, the backward marked ``@once_differentiable``."""

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return x.cos() * g


class ScaledBackward(torch.autograd.Function):
    """``2 x g`` whose own backward says ``(3 g gg, 2 x gg)``, not the derivative of its ops."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, g)
        return 2 * x * g

    @staticmethod
    def backward(ctx: Any, gg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, g = ctx.saved_tensors
        return 3 * g * gg, 2 * x * gg


class CustomInBackward(torch.autograd.Function):
    """A backward applying another custom function, whose own backward gives the second
    derivative."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return ScaledBackward.apply(x, g)


class DataInBackward(NoGradInBackward):
    """The derivative read through ``x.data``: a constant for eager's double backward."""

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return x.data.cos() * g


class DetachedInPlace(NoGradInBackward):
    """The derivative of a copy detached in place (``detach_``): a constant for eager too."""

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        c = x.cos()
        c.detach_()
        return c * g


@pytest.mark.parametrize(
    "function",
    [NoGradInBackward, OnceDifferentiable, CustomInBackward, DataInBackward, DetachedInPlace],
)
def test_a_second_derivative_through_a_backward_that_computes_without_grad_runs_eagerly(
    jit_engine: str, function: Any
) -> None:
    """Eager double backward takes what a custom backward computed under ``no_grad`` (or all of
    a ``@once_differentiable`` one) as constants, and differentiates another custom function the
    backward applies by that function's own backward. The traced product has only the ops:
    differentiated again, it would differ from the second call on. Such a step runs eagerly,
    warned, naming the function; with ``create_graph=False`` nothing is differentiated again
    and it compiles."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).double()
    step = _through(function, lin)
    jitted = ptj.jit(step)
    for i in range(3):
        x = torch.randn(4, 3, dtype=torch.float64) + i
        got, caught = _warnings_of(jitted, x)
        want = step(x)
        torch.testing.assert_close(got, want)
        parameters = list(lin.parameters())  # the bias may have no second derivative: None
        got_grads = torch.autograd.grad(got, parameters, allow_unused=True)
        for a, b in zip(got_grads, torch.autograd.grad(want, parameters, allow_unused=True)):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b)
        if i == 0 and captures_graph(jit_engine):
            assert any("create_graph=True" in w and function.__name__ in w for w in caught)
    assert not _compiled(jitted)

    def forces(x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_(True)
        return torch.autograd.grad(function.apply(lin(x)).sum(), x)[0]

    jitted_forces = ptj.jit(forces)
    for i in range(3):
        x = torch.randn(4, 3, dtype=torch.float64) + i
        torch.testing.assert_close(_warnings_of(jitted_forces, x)[0], forces(x))
    assert _compiled(jitted_forces) == captures_graph(jit_engine)


def test_a_gradient_through_a_function_class_made_per_call_uses_that_calls_tensor(
    jit_engine: str,
) -> None:
    """A class defined inside the step, closing over this call's ``k`` (per-call classes are one
    custom function, their tensors inputs): the gradient through it uses each call's ``k``."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).double()

    def step(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        class Scaled(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, u: torch.Tensor) -> torch.Tensor:
                ctx.save_for_backward(u)
                return (u * k).sin()

            @staticmethod
            def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
                (u,) = ctx.saved_tensors
                return g * (u * k).cos() * k

        x = x.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(Scaled.apply(lin(x)).sum(), x, create_graph=True)
        return g.square().sum()

    jitted = ptj.jit(step)
    for i in range(4):
        x, k = torch.randn(2, 3, dtype=torch.float64), torch.tensor(0.5 + i, dtype=torch.float64)
        got, _ = _warnings_of(jitted, x, k)
        _like_eager(got, step(x, k), lin)
    assert jitted.num_traces == 1
    assert _compiled(jitted) == captures_graph(jit_engine)


def test_a_custom_backward_that_reads_a_value_inside_the_gradient_runs_eagerly(
    jit_engine: str,
) -> None:
    """Traced, a branch of the backward on a tensor value would be baked in: eager, warned."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).double()
    step = _through(BranchingBackward, lin)
    jitted = ptj.jit(step)
    warned = []
    for sign in (1.0, -1.0, 1.0):
        x = sign * (torch.rand(4, 3, dtype=torch.float64) + 1)
        got, caught = _warnings_of(jitted, x)
        warned += caught
        torch.testing.assert_close(got, step(x))
    assert len(warned) == 1
    assert not _compiled(jitted)


def test_create_graph_false_and_unused_inputs_behave_as_eager(jit_engine: str) -> None:
    w = torch.randn(3, requires_grad=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[Any, ...]:
        x = x.detach().requires_grad_(True)
        y = y.detach().requires_grad_(True)
        gx, gy = torch.autograd.grad((x * w).sin().sum(), (x, y), allow_unused=True)
        return gx, gy, (x * w).sum()

    jitted = ptj.jit(step)
    for _ in range(3):
        x, y = torch.randn(3), torch.randn(3)
        (gx, gy, s), _ = _warnings_of(jitted, x, y)
        want = step(x, y)
        torch.testing.assert_close(gx, want[0])
        assert gy is None and not gx.requires_grad  # create_graph=False: detached, as eager
        torch.testing.assert_close(s, want[2])
    assert _compiled(jitted) == captures_graph(jit_engine)


def test_the_gradient_follows_new_values_and_cuts_where_eager_cuts(jit_engine: str) -> None:
    """A value under no_grad or detached enters the gradient as a constant, as in eager."""

    def step(x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_(True)
        with torch.no_grad():
            scale = x.abs().sum()
        with torch.no_grad():
            released = [x.abs().sum()]  # no name holds it once popped: judged by the rule
        y = x * scale + x.detach() ** 2 * x + (x + released.pop().exp())  # add saves neither
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return g

    jitted = ptj.jit(step)
    for seed in range(3):
        x = torch.randn(4, generator=seeded(seed), dtype=torch.float64)
        got, _ = _warnings_of(jitted, x)
        torch.testing.assert_close(got, step(x))
    assert jitted.num_traces == 1


def _rnn_energy(rnn: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: rnn(x.unsqueeze(1))[0].sum()  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda net: lambda x: torch.nn.functional.dropout(net(x), 0.5).sum(), "random op"),
        (lambda net: lambda x: net(x).relu_().sum(), "in-place op"),
        (lambda net: _rnn_energy(nn.LSTM(3, 3, num_layers=2, dropout=0.5)), "random op"),
    ],
    ids=["dropout", "in-place", "dropout-between-rnn-layers"],
)
def test_a_gradient_through_ops_a_replay_would_repeat_runs_eagerly_with_one_warning(
    jit_engine: str, make: Callable[..., Any], reason: str
) -> None:
    torch.manual_seed(0)
    net = nn.Linear(3, 3)
    energy = make(net)

    def step(x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_(True)
        return torch.autograd.grad(energy(x), x, create_graph=True)[0]

    jitted = ptj.jit(step)
    x = torch.randn(4, 3)
    (_, said) = _warnings_of(jitted, x)
    torch.manual_seed(1)
    got = jitted(x)
    torch.manual_seed(1)
    torch.testing.assert_close(got, step(x))
    assert len(said) == 1 and not _compiled(jitted)
    if captures_graph(jit_engine):
        assert reason in said[0]


@pytest.mark.parametrize(
    "energy",
    [lambda net: lambda x: torch.max(net(x), dim=1).values.sum(),
     lambda net: _rnn_energy(nn.GRU(3, 3, num_layers=2).double())],
    ids=["max-over-dim", "two-layer-GRU"],
)  # fmt: skip
def test_a_gradient_through_an_op_with_several_results_is_compiled(
    jit_engine: str, energy: Callable[..., Any]
) -> None:
    """Ops returning a tuple (``max(dim)``: values and indices; an RNN: output and states)
    are replayed like any other op, their results taken by index."""
    torch.manual_seed(0)
    step_of = energy(nn.Linear(3, 3).double())

    def step(x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_(True)
        return torch.autograd.grad(step_of(x), x, create_graph=True)[0]

    jitted = ptj.jit(step)
    said = []
    for seed in range(3):
        x = torch.randn(4, 3, generator=seeded(seed), dtype=torch.float64)
        got, warned = _warnings_of(jitted, x)
        torch.testing.assert_close(got, step(x))
        said += warned
    assert jitted.num_traces == 1
    assert len(said) == (0 if captures_graph(jit_engine) else 1)
    assert _compiled(jitted) == captures_graph(jit_engine)


def test_backward_inside_the_step_still_runs_eagerly_with_one_warning(jit_engine: str) -> None:
    w = torch.randn(3, requires_grad=True)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = (x * w).sum()
        loss.backward()
        return loss.detach()

    jitted = ptj.jit(step)
    _, said = _warnings_of(lambda: jitted(torch.randn(3)))
    assert len(said) == 1 and "backward" in said[0] and not _compiled(jitted)


def test_autograd_on_other_threads_is_untouched_while_a_capture_runs() -> None:
    from phi_torch_jit._inner_grad import functional_autograd

    x = torch.randn(3, requires_grad=True)
    results: list[Any] = []
    with functional_autograd():  # this thread is not tracing: the engine runs as always
        import threading

        thread = threading.Thread(target=lambda: results.append(torch.autograd.grad(
            (x**2).sum(), x)[0]))  # fmt: skip
        thread.start()
        thread.join()
        mine = torch.autograd.grad((x**3).sum(), x)[0]
    torch.testing.assert_close(results[0], 2 * x.detach())
    torch.testing.assert_close(mine, 3 * x.detach() ** 2)
    assert torch.autograd._engine_run_backward.__module__ == "torch.autograd.graph"


def test_an_inner_step_on_parameters_and_a_jacobian_inside_the_step_equal_eager(
    jit_engine: str,
) -> None:
    """Gradients with respect to module parameters (a MAML-style inner step) and
    ``torch.autograd.functional.jacobian``, which runs autograd.grad under its own name."""
    torch.manual_seed(0)
    net = nn.Linear(3, 1).double()

    def inner_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        params = list(net.parameters())
        loss = ((net(x) - y) ** 2).mean()
        grads = torch.autograd.grad(loss, params, create_graph=True)
        w, b = (p - 0.1 * g for p, g in zip(params, grads))
        return (((x @ w.t() + b) - y) ** 2).mean()

    def jacobian_norm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_(True)
        f = lambda z: torch.tanh(net(z)).sum(0)  # noqa: E731
        return torch.autograd.functional.jacobian(f, x, create_graph=True).square().sum() + y.sum()

    for step in (inner_step, jacobian_norm):
        jitted = ptj.jit(step)
        for seed in range(3):
            g = seeded(seed)
            x = torch.randn(4, 3, generator=g, dtype=torch.float64)
            y = torch.randn(4, 1, generator=g, dtype=torch.float64)
            got, _ = _warnings_of(jitted, x, y)
            want = step(x, y)
            torch.testing.assert_close(got, want)
            params = list(net.parameters())
            for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(want, params)):
                torch.testing.assert_close(a, b)
        assert jitted.num_traces == 1
        assert _compiled(jitted) == captures_graph(jit_engine)


class GradModeBranch(torch.autograd.Function):
    """A backward that branches on the grad mode, which eager sets to ``create_graph``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g * 3 * x**2 * (1.0 if torch.is_grad_enabled() else 2.0)


def test_a_custom_backward_runs_in_the_grad_mode_eager_gives_it(jit_engine: str) -> None:
    """A gradient inside the step with ``create_graph=False`` runs the custom backward with
    grad mode off in eager; traced with it on, a backward branching on the mode gave another
    value from the second call (found by a probe)."""

    def step(x: torch.Tensor) -> torch.Tensor:
        (again,) = torch.autograd.grad(GradModeBranch.apply(x).sum(), x, create_graph=True)
        (plain,) = torch.autograd.grad(GradModeBranch.apply(x).sum(), x)
        return again * x + plain

    jitted = ptj.jit(step)
    for i in range(3):
        x0 = torch.tensor([1.0, -2.0], dtype=torch.float64) * (i + 1)
        got, _ = _warnings_of(jitted, x0.clone().requires_grad_(True))
        torch.testing.assert_close(got, step(x0.clone().requires_grad_(True)))
    assert _compiled(jitted) == captures_graph(jit_engine)


@pytest.mark.parametrize("off", ["no_grad", "set_grad_enabled"])
def test_a_gradient_with_create_graph_under_no_grad_is_differentiable_as_in_eager(
    jit_engine: str, off: str
) -> None:
    """``grad(..., create_graph=True)`` under ``no_grad``: eager's engine builds the gradient's
    graph all the same; the program returned it without one from the second call (x.grad
    None, w.grad missing the second-order term; found by a probe)."""
    w = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64, requires_grad=True)

    def step(x: torch.Tensor) -> torch.Tensor:
        y = (torch.sin(x * w) * x).sum()
        with torch.no_grad() if off == "no_grad" else torch.set_grad_enabled(False):
            (g,) = torch.autograd.grad(y, x, create_graph=True)
        return g * w

    jitted = ptj.jit(step)
    for i in range(3):
        x0 = torch.tensor([0.3, 1.1, -0.7], dtype=torch.float64) * (i + 1)
        results = []
        for function in (jitted, step):
            x = x0.clone().requires_grad_(True)
            w.grad = None
            out, _ = _warnings_of(function, x)
            out.sum().backward()
            results.append((out.detach(), x.grad, w.grad.clone()))
        (got, got_x, got_w), (want, want_x, want_w) = results
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_x, want_x)
        torch.testing.assert_close(got_w, want_w)
    assert _compiled(jitted) == captures_graph(jit_engine)
