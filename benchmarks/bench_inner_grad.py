"""Autograd inside the step: training steps that take a gradient inside, one interleaved run.

Workloads (float32, CPU unless ``--device``), each a whole training iteration (the jitted loss,
``backward()`` of it, an Adam step outside the jitted function):

- ``potential``: a small neural interatomic potential (MLP on pair distances of 32 atoms)
  trained on energies and forces, ``F = -grad(E, pos, create_graph=True)``;
- ``pinn``: a Burgers residual ``u_t + u u_x - nu u_xx`` on 512 collocation points (tanh MLP,
  first and second derivatives by ``autograd.grad``);
- ``hamiltonian``: a Hamiltonian network's symplectic flow, 8 steps of ``dH/dq``, ``dH/dp``;
- ``e3nn_potential`` (needs e3nn): an equivariant interatomic potential of 16 atoms built from
  e3nn's parts (spherical harmonics, ``soft_one_hot_linspace`` with its smooth cutoff, a custom
  ``autograd.Function``, a tensor product convolution), trained on energies and forces.

Peers: eager; ours with the default engine, with engines "compile" and "torchscript"; raw
``torch.compile`` (which raises on double backward: its cell says so). For each: the first
call (the whole iteration), the median iteration time of the interleaved runs (their order rotates
each repetition) and its ratio to
eager, and the largest difference of the loss from eager's after the same iterations. Not a
test: ``python benchmarks/bench_inner_grad.py [--reps 30]``; ``make bench-inner-grad``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import phi_torch_jit as ptj


def potential_workload() -> tuple[nn.Module, Callable[[nn.Module], Callable[..., Any]], tuple]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 32), nn.SiLU(), nn.Linear(32, 32), nn.SiLU(), nn.Linear(32, 1))
    pos = torch.randn(32, 3) * 2
    energy, forces = torch.randn(()), torch.randn(32, 3)

    def make(net: nn.Module) -> Callable[..., Any]:
        def loss(pos: torch.Tensor, energy: torch.Tensor, forces: torch.Tensor) -> torch.Tensor:
            pos = pos.detach().requires_grad_(True)
            diff = pos[:, None, :] - pos[None, :, :]
            r = (diff.square().sum(-1) + 1e-3).sqrt()
            e = net(r.reshape(-1, 1)).sum() / 2
            (g,) = torch.autograd.grad(e, pos, create_graph=True)
            return (e - energy) ** 2 + ((-g - forces) ** 2).mean()

        return loss

    return net, make, (pos, energy, forces)


def pinn_workload() -> tuple[nn.Module, Callable[[nn.Module], Callable[..., Any]], tuple]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                        nn.Linear(32, 1))  # fmt: skip
    xt = torch.rand(512, 2)

    def make(net: nn.Module) -> Callable[..., Any]:
        def loss(xt: torch.Tensor) -> torch.Tensor:
            xt = xt.detach().requires_grad_(True)
            u = net(xt)
            (du,) = torch.autograd.grad(u.sum(), xt, create_graph=True)
            u_x, u_t = du[:, :1], du[:, 1:]
            (ddu,) = torch.autograd.grad(u_x.sum(), xt, create_graph=True)
            return ((u_t + u * u_x - 0.01 * ddu[:, :1]) ** 2).mean()

        return loss

    return net, make, (xt,)


def hamiltonian_workload() -> tuple[nn.Module, Callable[[nn.Module], Callable[..., Any]], tuple]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 64), nn.Softplus(), nn.Linear(64, 1))
    q, p = torch.randn(64), torch.randn(64)
    target = torch.randn(64)

    def make(net: nn.Module) -> Callable[..., Any]:
        def loss(q: torch.Tensor, p: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            for _ in range(8):
                qp = torch.stack([q, p], -1).requires_grad_(True)
                (dh,) = torch.autograd.grad(net(qp).sum(), qp, create_graph=True)
                p = p - 0.05 * dh[..., 0]
                q = q + 0.05 * dh[..., 1]
            return ((q - target) ** 2).mean()

        return loss

    return net, make, (q, p, target)


def e3nn_potential_workload() -> tuple[nn.Module, Callable[[nn.Module], Callable[..., Any]], tuple]:
    from e3nn import o3
    from e3nn.math import soft_one_hot_linspace
    from e3nn.nn import FullyConnectedNet

    torch.manual_seed(0)
    irreps_sh = o3.Irreps.spherical_harmonics(lmax=2)
    tp = o3.FullyConnectedTensorProduct("4x0e", irreps_sh, "4x0e + 2x1o", shared_weights=False)
    fc = FullyConnectedNet([8, 16, tp.weight_numel], torch.nn.functional.silu)
    net = nn.ModuleDict({"tp": tp, "fc": fc, "readout": o3.Linear("4x0e + 2x1o", "1x0e")})
    n = 16
    pos, energy, forces = torch.randn(n, 3) * 1.5, torch.randn(()), torch.randn(n, 3)
    kinds = torch.nn.functional.one_hot(torch.randint(0, 4, (n,)), 4).float()
    src = torch.arange(n).repeat_interleave(n - 1)
    dst = torch.tensor([j for i in range(n) for j in range(n) if j != i])

    def make(net: nn.Module) -> Callable[..., Any]:
        def loss(pos: torch.Tensor, energy: torch.Tensor, forces: torch.Tensor) -> torch.Tensor:
            pos = pos.detach().requires_grad_(True)
            edge = pos[src] - pos[dst]
            sh = o3.spherical_harmonics(irreps_sh, edge, True, normalization="component")
            emb = soft_one_hot_linspace(
                edge.norm(dim=1), 0.0, 2.5, 8, basis="smooth_finite", cutoff=True
            ).mul(8**0.5)
            messages = net["tp"](kinds[src], sh, net["fc"](emb))
            atoms = torch.zeros(n, messages.shape[1]).index_add(0, dst, messages)
            e = net["readout"](atoms).sum()
            (g,) = torch.autograd.grad(e, pos, create_graph=True)
            return (e - energy) ** 2 + ((-g - forces) ** 2).mean()

        return loss

    return net, make, (pos, energy, forces)


WORKLOADS = {"potential": potential_workload, "pinn": pinn_workload,
             "hamiltonian": hamiltonian_workload,
             "e3nn_potential": e3nn_potential_workload}  # fmt: skip


def _peers() -> dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]]:
    return {
        "eager": lambda f: f,
        "ours (default)": ptj.jit,
        "ours (compile)": lambda f: ptj.jit(f, engine="compile"),
        "ours (torchscript)": lambda f: ptj.jit(f, engine="torchscript"),
        "raw torch.compile": torch.compile,
    }


def _iteration(loss: Callable[..., Any], optimizer: torch.optim.Optimizer, args: tuple) -> float:
    optimizer.zero_grad()
    value = loss(*args)
    value.backward()
    optimizer.step()
    return float(value.detach())


def _difference(
    make: Callable[[nn.Module], Callable[..., Any]],
    loss: Callable[..., Any],
    model: nn.Module,
    args: tuple,
) -> float:
    """The largest difference of the loss and its parameter gradients from eager code's, at the
    parameters this peer's training reached (each peer trains its own copy)."""
    reference = copy.deepcopy(model)
    want = make(reference)(*args)
    got = loss(*args)
    grads = torch.autograd.grad(got, list(model.parameters()), allow_unused=True)
    wanted = torch.autograd.grad(want, list(reference.parameters()), allow_unused=True)
    pairs = [(got, want), *((a, b) for a, b in zip(grads, wanted) if a is not None)]
    return max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in pairs)


def run(name: str, reps: int) -> list[str]:
    net, make, args = WORKLOADS[name]()
    running: dict[str, tuple[Callable[..., Any], torch.optim.Optimizer, nn.Module]] = {}
    cells: dict[str, str] = {}
    first: dict[str, float] = {}
    for peer, wrap in _peers().items():
        model = copy.deepcopy(net)
        loss = wrap(make(model))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        try:
            start = time.perf_counter()
            _iteration(loss, optimizer, args)
            first[peer] = time.perf_counter() - start
            for _ in range(3):
                _iteration(loss, optimizer, args)
            if isinstance(loss, ptj.JitFunction):
                loss.wait_compiled()
                for _ in range(30):  # past the meter's comparison with eager
                    _iteration(loss, optimizer, args)
            running[peer] = (loss, optimizer, model)
        except Exception as error:  # a peer that cannot run this workload
            message = (str(error).strip().splitlines() or [""])[0][:70]
            cells[peer] = f"fails: {type(error).__name__}: {message}"
            torch._dynamo.reset()
    times: dict[str, list[float]] = {peer: [] for peer in running}
    order = list(running.items())
    for rep in range(reps):  # the order rotates: a peer run right after eager code measured
        turn = rep % len(order)  # about 5% slower (caches), whichever it was
        for peer, (loss, optimizer, _) in order[turn:] + order[:turn]:
            start = time.perf_counter()
            _iteration(loss, optimizer, args)
            times[peer].append(time.perf_counter() - start)
    differences = {peer: _difference(make, loss, model, args)
                   for peer, (loss, _, model) in running.items()}  # fmt: skip
    eager = statistics.median(times["eager"])
    rows = []
    for peer in _peers():
        if peer in times:
            median = statistics.median(times[peer])
            compiled = "runs eagerly" not in getattr(running[peer][0], "explain", lambda: "")()
            note = "" if compiled else ", eager (warned)"
            cell = (f"{median * 1e3:.2f} ms | {median / eager:.2f}x | {first[peer]:.2f} s | "
                    f"{differences[peer]:.1e}{note}")  # fmt: skip
        else:
            cell = f"{cells[peer]} | | |"
        rows.append(f"| {name} | {peer} | {cell} |")
    print("\n".join(rows), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    for name in args.workloads:
        rows += run(name, args.reps)
    print(f"\ntorch {torch.__version__}, CPU, {torch.get_num_threads()} threads, medians of "
          f"{args.reps} interleaved iterations, ratio to eager\n")  # fmt: skip
    print("| workload | peer | iteration | ratio | first call | loss, grads vs eager |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
