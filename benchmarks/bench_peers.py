"""Smoke-step workloads against peers: eager, raw torch.jit.trace, raw torch.compile, ours.

Workloads (2-D, periodic, float32, written here in plain PyTorch):

(a) smoke step: semi-Lagrangian advection (grid_sample), buoyancy, 30 Jacobi pressure iterations;
(b) the same with the pressure solve as a conjugate-gradient custom-gradient function with a
    residual-based stopping rule (a data-dependent ``while`` loop);
(c) a training iteration: 4 unrolled steps of (b) plus a 2-layer CNN correction, loss, backward.

For each peer: first-call time, median step time and its ratio to eager, and the max abs
difference to eager on the same state, a new state and a state at rest (a traced CG bakes its
iteration count: wrong on new states, NaN at rest). Peers run side by side in one process.
Writes JSON and markdown to benchmarks/results/. Not a test. Issue 5 (engine "compile") adds a
row for our compile engine; PhiML's jit and the PhiFlow workload (d) are not here yet.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import phi_torch_jit as ptj

DT = 1.0


def laplace(p: torch.Tensor) -> torch.Tensor:
    return (
        torch.roll(p, 1, -1) + torch.roll(p, -1, -1) + torch.roll(p, 1, -2) + torch.roll(p, -1, -2)
    ) - 4 * p


def divergence(v: torch.Tensor) -> torch.Tensor:
    return (v[:, 0] - torch.roll(v[:, 0], 1, -1)) + (v[:, 1] - torch.roll(v[:, 1], 1, -2))


def gradient(p: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.roll(p, -1, -1) - p, torch.roll(p, -1, -2) - p], dim=1)


def advect(field: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    n = field.shape[-1]
    ys, xs = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    x = (xs - DT * v[:, 0]) / (n - 1) * 2 - 1
    y = (ys - DT * v[:, 1]) / (n - 1) * 2 - 1
    grid = torch.stack([x, y], dim=-1)
    return F.grid_sample(field, grid, align_corners=True, padding_mode="border")


def jacobi(div: torch.Tensor, iterations: int = 30) -> torch.Tensor:
    p = torch.zeros_like(div)
    for _ in range(iterations):
        neighbours = (
            torch.roll(p, 1, -1)
            + torch.roll(p, -1, -1)
            + torch.roll(p, 1, -2)
            + torch.roll(p, -1, -2)
        )
        p = (neighbours - div) / 4
    return p


def cg(div: torch.Tensor) -> torch.Tensor:
    """Solve (0.01 - Laplace) p = -div by CG, stopping on the residual."""
    b = -div
    x = torch.zeros_like(b)
    r = b.clone()
    d = r.clone()
    rs = (r * r).sum()
    tol = 1e-10 * (b * b).sum() + 1e-30
    it = 0
    while bool(rs > tol) and it < 500:
        ad = 0.01 * d - (
            torch.roll(d, 1, -1)
            + torch.roll(d, -1, -1)
            + torch.roll(d, 1, -2)
            + torch.roll(d, -1, -2)
            - 4 * d
        )
        alpha = rs / (d * ad).sum()
        x = x + alpha * d
        r = r - alpha * ad
        rs_new = (r * r).sum()
        d = r + rs_new / rs * d
        rs = rs_new
        it += 1
    return x


def _cg_gradient(inputs: Any, outputs: Any, grads: Any) -> tuple[Any]:
    return (-cg_solve(-grads[0]),)  # symmetric operator: the adjoint is the same solve


cg_solve = ptj.custom_gradient(cg, _cg_gradient, name="cg_pressure")


def step_a(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = advect(s, v)
    v = torch.cat([advect(v[:, i : i + 1], v) for i in range(2)], dim=1)
    v = v + DT * torch.cat([torch.zeros_like(s), 0.1 * s], dim=1)
    p = jacobi(divergence(v))
    return v - gradient(p), s


def step_b(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = advect(s, v)
    v = torch.cat([advect(v[:, i : i + 1], v) for i in range(2)], dim=1)
    v = v + DT * torch.cat([torch.zeros_like(s), 0.1 * s], dim=1)
    p = cg_solve(divergence(v))
    return v - gradient(p), s


def make_training(net: nn.Module) -> Callable[..., torch.Tensor]:
    def training_loss(v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            v, s = step_b(v, s)
            v = v + 0.1 * net(v)
        return (v**2).mean() + (s**2).mean()

    return training_loss


def states(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(1, 2, n, n, generator=g) * 0.5
    s = torch.rand(1, 1, n, n, generator=g)
    return v, s


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def max_diff(a: Any, b: Any) -> float:
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return max(float((x - y).detach().abs().max()) for x, y in zip(a, b))


def peers(fn: Callable[..., Any], example: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """Build each peer (lazily compiled ones compile at their first call)."""
    result: dict[str, Any] = {"eager": fn, "ours (torchscript)": ptj.jit(fn)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            result["raw torch.jit.trace"] = torch.jit.trace(fn, example, check_trace=False)
        except Exception as error:  # e.g. modules with trainable parameters
            result["raw torch.jit.trace"] = f"fails: {type(error).__name__}"
    result["raw torch.compile"] = torch.compile(fn)
    return result


def bench(name: str, fn: Callable[..., Any], n: int, reps: int, grad: bool) -> list[dict[str, Any]]:
    same, new = states(n, 0), states(n, 1)
    rest = (torch.zeros_like(same[0]), torch.zeros_like(same[1]))
    if grad:
        same = (same[0].requires_grad_(), same[1])

    def call(f: Callable[..., Any], args: tuple[torch.Tensor, ...]) -> Any:
        out = f(*args)
        if grad:
            out.backward()
        return out

    inputs = {"same": same, "new": new, "rest": rest}
    reference = {key: call(fn, args) for key, args in inputs.items()}
    rows = [_measure(name, n, peer, f, inputs, reference, call, reps)
            for peer, f in peers(fn, same).items()]  # fmt: skip
    eager = next(r["step_s"] for r in rows if r["peer"] == "eager")
    for r in rows:
        if "step_s" in r:
            r["ratio"] = r["step_s"] / eager
    return rows


def _measure(
    name: str,
    n: int,
    peer: str,
    f: Any,
    inputs: dict[str, tuple[torch.Tensor, ...]],
    reference: dict[str, Any],
    call: Callable[..., Any],
    reps: int,
) -> dict[str, Any]:
    row: dict[str, Any] = {"workload": name, "N": n, "peer": peer}
    if isinstance(f, str):
        return {**row, "note": f}
    first = timed(lambda: call(f, inputs["same"]))
    for key, args in inputs.items():
        row[f"diff_{key}"] = max_diff(call(f, args), reference[key])
    for _ in range(3):
        call(f, inputs["same"])
    times = [timed(lambda: call(f, inputs["same"])) for _ in range(reps)]
    return {**row, "first_call_s": first, "step_s": statistics.median(times)}


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | N | peer | first call | step | ratio | diff same | diff new | diff rest |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "note" in r:
            lines.append(f"| {r['workload']} | {r['N']} | {r['peer']} | {r['note']} | | | | | |")
            continue
        lines.append(
            f"| {r['workload']} | {r['N']} | {r['peer']} | {r['first_call_s']:.2f} s "
            f"| {r['step_s'] * 1e3:.2f} ms | {r['ratio']:.2f}x | {r['diff_same']:.1e} "
            f"| {r['diff_new']:.1e} | {r['diff_rest']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 8, 3, padding=1, padding_mode="circular"), nn.Tanh(),
                        nn.Conv2d(8, 2, 3, padding=1, padding_mode="circular"))  # fmt: skip
    rows: list[dict[str, Any]] = []
    for n in args.sizes:
        rows += bench("(a) smoke, Jacobi", step_a, n, args.reps, grad=False)
        rows += bench("(b) smoke, CG custom fn", step_b, n, args.reps, grad=False)
        rows += bench("(c) training, 4 steps + CNN", make_training(net), n, args.reps, grad=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peers.json").write_text(json.dumps(rows, indent=2))
    text = table(rows)
    (args.out / "peers.md").write_text(text + "\n")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, medians of {args.reps}")
    print(text)


if __name__ == "__main__":
    main()
