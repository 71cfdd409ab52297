"""Neural ODE/SDE programs: torchdiffeq (examples/ode_demo.py), torchode (README), torchsde
(README and examples/latent_sde.py), tiny sizes."""

from __future__ import annotations

import torch
from torch import nn

from .harness import Built, Program


class ODEFunc(nn.Module):
    """torchdiffeq examples/ode_demo.py."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 2))
        for m in self.net.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0, std=0.1)
                nn.init.constant_(m.bias, val=0)

    def forward(self, t, y):
        return self.net(y**3)


def _spiral_data(n_t: int = 20):
    """ode_demo.py's spiral: the true trajectory solved by odeint (dopri5), t in [0, 2]."""
    import torchdiffeq

    true_y0 = torch.tensor([[2.0, 0.0]])
    t = torch.linspace(0.0, 2.0, n_t)
    true_A = torch.tensor([[-0.1, 2.0], [-2.0, -0.1]])

    class Lambda(nn.Module):
        def forward(self, t, y):
            return torch.mm(y**3, true_A)

    with torch.no_grad():
        true_y = torchdiffeq.odeint(Lambda(), true_y0, t, method="dopri5")
    return t, true_y


def _ode_demo(method: str | None, adjoint: bool, options: dict | None = None) -> Built:
    import torchdiffeq

    odeint = torchdiffeq.odeint_adjoint if adjoint else torchdiffeq.odeint
    t, true_y = _spiral_data()
    func = ODEFunc()
    optimizer = torch.optim.RMSprop(func.parameters(), lr=1e-3)
    batch_time, batch_size = 5, 4
    starts = torch.randint(0, len(t) - batch_time, (4, batch_size))

    def get_batch(k):
        s = starts[k]
        batch_y0 = true_y[s]  # (M, 1, D)
        batch_t = t[:batch_time]
        batch_y = torch.stack([true_y[s + i] for i in range(batch_time)], dim=0)
        return batch_y0, batch_t, batch_y

    def train_step(batch_y0, batch_t, batch_y):
        kwargs = {} if method is None else {"method": method}
        if options is not None:
            kwargs["options"] = options
        pred_y = odeint(func, batch_y0, batch_t, **kwargs)
        return torch.mean(torch.abs(pred_y - batch_y))

    return Built(train_step, get_batch, [func], optimizer)


def torchdiffeq_dopri5() -> Built:
    return _ode_demo(None, adjoint=False)


def torchdiffeq_adjoint() -> Built:
    return _ode_demo(None, adjoint=True)


def torchdiffeq_rk4() -> Built:
    return _ode_demo("rk4", adjoint=False, options={"step_size": 0.05})


def torchode_dopri5() -> Built:
    """torchode README: ODETerm, Dopri5, IntegralController, AutoDiffAdjoint, batched IVPs."""
    import torchode as to

    net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 2))

    def f(t, y):
        return net(y)

    term = to.ODETerm(f)
    step_method = to.Dopri5(term=term)
    step_size_controller = to.IntegralController(atol=1e-6, rtol=1e-3, term=term)
    solver = to.AutoDiffAdjoint(step_method, step_size_controller)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    y0s = torch.randn(4, 5, 2)
    t_eval = torch.linspace(0.0, 1.0, 6).repeat(5, 1)
    targets = torch.randn(4, 5, 6, 2) * 0.1

    def train_step(y0, t_eval, target):
        sol = solver.solve(to.InitialValueProblem(y0=y0, t_eval=t_eval))
        return ((sol.ys - target) ** 2).mean()

    return Built(train_step, lambda k: (y0s[k], t_eval, targets[k]), [net], optimizer)


def torchode_tsit5_pid() -> Built:
    """torchode with Tsit5 and a PID controller, solver compiled per its docs' advice is not
    applied (that is what phi_torch_jit is for)."""
    import torchode as to

    class VectorField(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, t, y):
            return torch.tanh(self.lin(y)) - 0.1 * y

    vf = VectorField()
    term = to.ODETerm(vf)
    step_method = to.Tsit5(term=term)
    controller = to.PIDController(
        atol=1e-5, rtol=1e-3, pcoeff=0.2, icoeff=0.5, dcoeff=0.0, term=term
    )
    solver = to.AutoDiffAdjoint(step_method, controller)
    optimizer = torch.optim.SGD(vf.parameters(), lr=1e-2)
    y0s = torch.randn(4, 3, 3)
    t_eval = torch.linspace(0.0, 2.0, 5).repeat(3, 1)

    def train_step(y0, t_eval):
        sol = solver.solve(to.InitialValueProblem(y0=y0, t_eval=t_eval))
        return sol.ys[:, -1].pow(2).sum()

    return Built(train_step, lambda k: (y0s[k], t_eval), [vf], optimizer)


class SDE(nn.Module):
    """torchsde README: an Ito SDE with diagonal noise and neural drift/diffusion."""

    noise_type = "diagonal"
    sde_type = "ito"

    def __init__(self, state_size: int = 3) -> None:
        super().__init__()
        self.mu = nn.Linear(state_size, state_size)
        self.sigma = nn.Linear(state_size, state_size)

    def f(self, t, y):
        return self.mu(y)

    def g(self, t, y):
        return torch.sigmoid(self.sigma(y))


def torchsde_euler() -> Built:
    import torchsde

    sde = SDE()
    optimizer = torch.optim.Adam(sde.parameters(), lr=1e-2)
    y0s = torch.full((4, 8, 3), 0.1) + 0.05 * torch.randn(4, 8, 3)
    ts = torch.linspace(0, 1, 6)

    def train_step(y0, ts):
        bm = torchsde.BrownianInterval(t0=0.0, t1=1.0, size=(8, 3), device=y0.device, entropy=1234)
        ys = torchsde.sdeint(sde, y0, ts, bm=bm, method="euler", dt=0.05)
        return ys[-1].pow(2).mean()

    return Built(train_step, lambda k: (y0s[k], ts), [sde], optimizer)


class StratSDE(SDE):
    sde_type = "stratonovich"


def torchsde_adjoint_midpoint() -> Built:
    """sdeint_adjoint (Stratonovich, midpoint), Brownian motion drawn from torch's RNG."""
    import torchsde

    sde = StratSDE()
    optimizer = torch.optim.Adam(sde.parameters(), lr=1e-2)
    y0s = torch.full((4, 8, 3), 0.1) + 0.05 * torch.randn(4, 8, 3)
    ts = torch.linspace(0, 1, 4)

    def train_step(y0, ts):
        ys = torchsde.sdeint_adjoint(sde, y0, ts, method="midpoint", dt=0.1)
        return ys[-1].pow(2).mean()

    return Built(train_step, lambda k: (y0s[k], ts), [sde], optimizer)


PROGRAMS = [
    Program(
        "torchdiffeq_odeint_dopri5",
        "torchdiffeq",
        "torchdiffeq",
        torchdiffeq_dopri5,
        "ode_demo.py: odeint (dopri5, adaptive) neural ODE, RMSprop",
    ),
    Program(
        "torchdiffeq_odeint_adjoint",
        "torchdiffeq",
        "torchdiffeq",
        torchdiffeq_adjoint,
        "ode_demo.py --adjoint: odeint_adjoint (dopri5), RMSprop",
    ),
    Program(
        "torchdiffeq_odeint_rk4",
        "torchdiffeq",
        "torchdiffeq",
        torchdiffeq_rk4,
        "odeint method='rk4' step_size=0.05, RMSprop",
    ),
    Program(
        "torchode_dopri5",
        "torchode",
        "torchode",
        torchode_dopri5,
        "README: Dopri5 + IntegralController + AutoDiffAdjoint, batched, Adam",
    ),
    Program(
        "torchode_tsit5_pid",
        "torchode",
        "torchode",
        torchode_tsit5_pid,
        "Tsit5 + PIDController, nn.Module vector field, SGD",
    ),
    Program(
        "torchsde_sdeint_euler",
        "torchsde",
        "torchsde",
        torchsde_euler,
        "README: sdeint Ito diagonal, BrownianInterval(entropy=...), euler, Adam",
    ),
    Program(
        "torchsde_adjoint_midpoint",
        "torchsde",
        "torchsde",
        torchsde_adjoint_midpoint,
        "sdeint_adjoint Stratonovich midpoint, default Brownian motion, Adam",
    ),
]
