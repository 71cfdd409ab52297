"""PhiFlow smoke plume, jitted with phi_torch_jit: the main demo.

A buoyant smoke plume in a closed box: semi-Lagrangian (MacCormack) advection,
buoyancy, and a pressure projection whose conjugate-gradient solve is PhiML's
custom-gradient function (captured by phi_torch_jit; its convergence loop is
kept, not baked). The demo runs the same simulation eagerly and jitted from
the same state, checks that they agree, writes the final frame (PNG) and the
time series (GIF) to the output folder, and prints steps per second of both,
measured in the same run.

Run ``python demos/smoke_plume.py --help`` for the flags.
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from phi.torch.flow import (
    ZERO_GRADIENT,
    Box,
    CenteredGrid,
    Solve,
    Sphere,
    StaggeredGrid,
    advect,
    fluid,
    math,
    resample,
)
from tqdm import tqdm

import phi_torch_jit as ptj


def make_step(inflow: Any, buoyancy: float = 0.1, dt: float = 1.0) -> Any:
    """One smoke step: advect, add inflow and buoyancy, make incompressible."""

    def smoke_step(v: Any, s: Any) -> tuple[Any, Any]:
        s = advect.mac_cormack(s, v, dt) + inflow * dt
        force = resample(s * (0, buoyancy), to=v)
        v = advect.semi_lagrangian(v, v, dt) + force * dt
        solve = Solve("CG", 1e-4, 1e-4, max_iterations=1000, x0=None, rank_deficiency=0)
        v, _ = fluid.make_incompressible(v, (), solve)
        return v, s

    return smoke_step


def initial_state(size: int) -> tuple[Any, Any, Any]:
    """(velocity, smoke, inflow) on a box of 100 x 100 units, ``size`` cells per side."""
    domain = Box(x=100, y=100)
    smoke = CenteredGrid(0.0, ZERO_GRADIENT, domain, x=size, y=size)
    inflow = resample(Sphere(x=50, y=9.5, radius=5), to=smoke, soft=True) * 0.2
    velocity = StaggeredGrid(0.0, 0, domain, x=size, y=size)
    return velocity, smoke, inflow


def run(step: Any, v: Any, s: Any, steps: int, label: str) -> tuple[list[Any], float]:
    """Run ``steps`` steps; return (smoke frames, seconds per step after the first)."""
    frames = [s]
    times = []
    for _ in tqdm(range(steps), desc=label, leave=False):
        start = time.perf_counter()
        v, s = step(v, s)
        times.append(time.perf_counter() - start)
        frames.append(s)
    rest = times[1:] or times
    return frames, sum(rest) / len(rest)


def save_pictures(out: Path, frames: Sequence[Any]) -> tuple[Path, Path] | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.animation import FuncAnimation, PillowWriter
    except ImportError:
        return None
    images = [f.values.numpy("y,x") for f in frames]
    vmax = max(float(i.max()) for i in images) or 1.0
    fig, ax = plt.subplots(figsize=(4, 4))
    image = ax.imshow(images[-1], origin="lower", cmap="magma", vmin=0, vmax=vmax)
    ax.set_title(f"smoke after {len(frames) - 1} steps (jit)")
    ax.axis("off")
    png = out / "smoke_plume.png"
    fig.savefig(png, dpi=100)

    def draw(i: int) -> Any:
        image.set_data(images[i])
        ax.set_title(f"step {i}")
        return (image,)

    gif = out / "smoke_plume.gif"
    FuncAnimation(fig, draw, frames=len(images), blit=True).save(gif, writer=PillowWriter(fps=10))
    plt.close(fig)
    return png, gif


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=32, help="cells per side (default 32)")
    parser.add_argument("--steps", type=int, default=40, help="jitted time steps (default 40)")
    parser.add_argument(
        "--eager-steps", type=int, default=8, help="eager steps for the comparison (default 8)"
    )
    parser.add_argument(
        "--engine",
        default=None,
        choices=["auto", "compile", "torchscript", "eager"],
        help="jit engine (default: phi_torch_jit's default, 'auto'; torchscript is legacy)",
    )
    parser.add_argument("--out", type=Path, default=Path("out/smoke_plume"), help="output folder")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    logging.getLogger("phiml").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="Sparse CSR")
    v0, s0, inflow = initial_state(args.size)
    step = make_step(inflow)
    jitted = ptj.jit(step, engine=args.engine)

    start = time.perf_counter()
    jitted(v0, s0)
    first_call = time.perf_counter() - start
    jit_frames, jit_step = run(jitted, v0, s0, args.steps, "jit")
    eager_frames, eager_step = run(step, v0, s0, args.eager_steps, "eager")
    n = min(len(jit_frames), len(eager_frames)) - 1
    diff = float(math.max(abs(jit_frames[n].values - eager_frames[n].values)))

    args.out.mkdir(parents=True, exist_ok=True)
    pictures = save_pictures(args.out, jit_frames)
    engine = args.engine or "default"
    print(f"smoke plume {args.size}x{args.size}, {args.steps} steps, engine {engine!r}")
    print(f"first jitted call (record + compile + trace): {first_call:.2f} s")
    print(f"max |eager - jit| of the smoke after {n} steps: {diff:.2e}")
    print(f"output: {', '.join(map(str, pictures)) if pictures else '(no matplotlib)'}")
    print(
        f"steps per second: eager {1 / eager_step:.1f}, jit {1 / jit_step:.1f} "
        f"(jit step time {jit_step / eager_step:.2f}x eager)"
    )
    return {
        "first_call_s": first_call,
        "max_diff": diff,
        "eager_step_s": eager_step,
        "jit_step_s": jit_step,
    }


if __name__ == "__main__":
    main()
