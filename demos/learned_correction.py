"""Learned correction: a small CNN corrects a coarse implicit solver, trained through jit.

The fine "truth" solves reaction-diffusion (Allen-Cahn: u_t = k Laplace u + u - u^3)
with four implicit sub-steps per time step; the coarse solver takes one implicit
diffusion step with the whole dt and ignores the reaction term. A CNN (an
nn.Module) learns the difference: ``u_next = coarse(u) + dt * net(u)``. Training
unrolls several jitted steps -- each with a CG solve that is a custom-gradient
function -- and backpropagates through all of them into the network.

Run ``python demos/learned_correction.py --help`` for the flags. Data-parallel on CPUs:
``torchrun --nproc_per_node=2 demos/learned_correction.py`` -- each rank simulates its own
batch of initial conditions and DistributedDataParallel averages the gradients (gloo; pass
``--backend nccl`` on GPUs). See docs/distributed.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from diffusion_cg import Source, solve

import phi_torch_jit as ptj

DT, K = 0.5, 0.4


def fine_step(u: torch.Tensor, k: torch.Tensor, substeps: int = 4) -> torch.Tensor:
    h = DT / substeps
    for _ in range(substeps):
        u = solve(u + h * (u - u**3), k * h)
    return u


def make_corrected_step(net: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def corrected_step(u: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return solve(u, k * DT) + DT * net(u)

    return corrected_step


def make_unrolled_loss(step: Callable[..., torch.Tensor], unroll: int) -> Callable[..., Any]:
    def unrolled_loss(u0: torch.Tensor, targets: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        u, loss = u0, torch.zeros(())
        for i in range(unroll):
            u = step(u, k)
            loss = loss + ((u - targets[i]) ** 2).mean()
        return loss / unroll

    return unrolled_loss


class Trainer(nn.Module):
    """The jitted training loss as a module: what DistributedDataParallel wraps.

    DDP's own forward (gradient-reduction bookkeeping, buffer broadcasts) runs as Python
    around the compiled call; see docs/distributed.md.
    """

    def __init__(self, net: nn.Module, unroll: int, engine: str | None = None) -> None:
        super().__init__()
        self.net = net
        self.loss = ptj.jit(make_unrolled_loss(make_corrected_step(net), unroll), engine=engine)

    def forward(self, u0: torch.Tensor, targets: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return self.loss(u0, targets, k)


def training_data(size: int, unroll: int, batch: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    u0 = 0.8 * torch.tanh(3 * torch.randn(batch, 1, size, size, generator=generator))
    k = torch.tensor(0.4)
    targets, u = [], u0
    with torch.no_grad():
        for _ in range(unroll):
            u = fine_step(u, k)
            targets.append(u)
    return u0, torch.stack(targets), k


def train(loss_fn: Callable[..., Any], net: nn.Module, data: Any, iters: int, label: str) -> Any:
    optimizer = torch.optim.Adam(net.parameters(), lr=3e-3)
    losses, times = [], []
    for _ in tqdm(range(iters), desc=label, leave=False):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_fn(*data)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    return losses, statistics.median(times[1:] or times)


def save_picture(path: Path, losses: Sequence[float], fields: Sequence[tuple[str, Any]]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 1 + len(fields), figsize=(3.2 * (1 + len(fields)), 3))
    axes[0].semilogy(losses)
    axes[0].set_title("training loss (jit)")
    axes[0].set_xlabel("iteration")
    for ax, (title, field) in zip(axes[1:], fields):
        ax.imshow(field.detach()[0, 0].numpy(), cmap="coolwarm", vmin=-1, vmax=1)
        ax.set_title(title)
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=32, help="grid points per side (default 32)")
    parser.add_argument("--unroll", type=int, default=4, help="unrolled steps (default 4)")
    parser.add_argument("--iters", type=int, default=60, help="training iterations (default 60)")
    parser.add_argument("--batch", type=int, default=4, help="initial conditions (default 4)")
    parser.add_argument(
        "--engine",
        default=None,
        choices=["auto", "compile", "torchscript", "eager"],
        help="jit engine (default: phi_torch_jit's default, 'auto'; torchscript is legacy)",
    )
    parser.add_argument("--out", type=Path, default=Path("out/learned_correction"))
    parser.add_argument(
        "--backend", default="gloo", help="torch.distributed backend under torchrun (gloo, nccl)"
    )
    return parser.parse_args(argv)


def main_distributed(args: argparse.Namespace) -> dict[str, float]:
    """One rank of a torchrun job: its own initial conditions, gradients averaged by DDP."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group(args.backend)  # rendezvous from torchrun's environment variables
    rank, world = dist.get_rank(), dist.get_world_size()
    model = None
    try:
        data = training_data(args.size, args.unroll, args.batch, seed=rank)
        torch.manual_seed(0)  # the same initial network on every rank
        net = Source()
        model = DistributedDataParallel(Trainer(net, args.unroll, args.engine))
        losses, iteration = train(model, net, data, args.iters, f"train (rank {rank})")
    finally:
        # DDP's reducer sits in reference cycles and holds the process group's last work:
        # left to the interpreter's shutdown, Gloo's threads released tensors then and the
        # rank aborted ("terminate called without an active exception") in about 1 run in 12
        del model
        gc.collect()
        dist.destroy_process_group()
    if rank == 0:
        print(f"learned correction {args.size}x{args.size}, {world} ranks x {args.batch} ICs")
        print(f"loss on rank 0: {losses[0]:.3e} -> {losses[-1]:.3e} in {args.iters} iterations")
        print(f"iterations per second ({world} processes): {1 / iteration:.1f}")
    return {"loss_first": losses[0], "loss_last": losses[-1], "jit_iter_s": iteration}


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return main_distributed(args)
    data = training_data(args.size, args.unroll, args.batch, seed=0)

    torch.manual_seed(0)
    net = Source()
    jit_loss = ptj.jit(
        make_unrolled_loss(make_corrected_step(net), args.unroll), engine=args.engine
    )
    losses, jit_time = train(jit_loss, net, data, args.iters, "train (jit)")

    torch.manual_seed(0)
    eager_net = Source()
    eager_loss = make_unrolled_loss(make_corrected_step(eager_net), args.unroll)
    eager_iters = max(3, min(args.iters, 10))
    eager_losses, eager_time = train(eager_loss, eager_net, data, eager_iters, "train (eager)")
    agree = abs(eager_losses[-1] - losses[eager_iters - 1]) / max(eager_losses[-1], 1e-12)

    with torch.no_grad():
        u0, targets, k = data
        coarse = solve(u0, k * DT)
        corrected = make_corrected_step(net)(u0, k)
        errors = {
            "coarse": float(((coarse - targets[0]) ** 2).mean()),
            "corrected": float(((corrected - targets[0]) ** 2).mean()),
        }
    args.out.mkdir(parents=True, exist_ok=True)
    picture = args.out / "learned_correction.png"
    fields = [("fine (truth)", targets[0]), ("coarse", coarse), ("coarse + CNN", corrected)]
    wrote = save_picture(picture, losses, fields)
    print(f"learned correction {args.size}x{args.size}, {args.unroll} unrolled steps")
    print(f"loss {losses[0]:.3e} -> {losses[-1]:.3e} in {args.iters} jitted iterations")
    print(
        f"one-step error vs fine solver: coarse {errors['coarse']:.2e}, "
        f"corrected {errors['corrected']:.2e}"
    )
    print(f"eager and jit training agree after {eager_iters} iterations (rel. diff {agree:.1e})")
    print(f"output: {picture if wrote else '(no matplotlib)'}")
    print(
        f"iterations per second: eager {1 / eager_time:.1f}, jit {1 / jit_time:.1f} "
        f"(jit iteration time {jit_time / eager_time:.2f}x eager)"
    )
    return {
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "agreement": agree,
        "eager_iter_s": eager_time,
        "jit_iter_s": jit_time,
        **errors,
    }


if __name__ == "__main__":
    main()
