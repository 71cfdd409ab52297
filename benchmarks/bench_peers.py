"""Smoke-step workloads against every peer, side by side in one process.

Workloads (2-D, periodic, float32, written here in plain PyTorch, except (d)):

(a) smoke step: semi-Lagrangian advection (grid_sample), buoyancy, 30 Jacobi pressure iterations;
(b) the same with the pressure solve as a conjugate-gradient custom-gradient function with a
    residual-based stopping rule (a data-dependent ``while`` loop);
(c) a training iteration: 4 unrolled steps of (b) plus a 2-layer CNN correction, loss, backward;
(d) the PhiFlow smoke plume step of ``demos/smoke_plume.py`` (PhiML CG pressure solve).

Peers: eager, raw torch.jit.trace, raw torch.compile (inductor), PhiML's torch jit (with PhiML's
own custom gradient for the CG), ours with engines "torchscript", "compile" and "auto"
(inductor). Each peer runs in an empty inductor cache directory of its own, so first calls are
cold starts for everyone. For each: first-call time, median step time (the peers' calls
interleaved) and its ratio to eager, the max relative difference to eager on the same state, a
new state and a state at rest (a traced CG bakes its iteration count: wrong on new states, NaN
at rest), and the graph breaks torch.compile reported. Writes JSON, markdown (with the issue's
targets checked) and a PNG plot to benchmarks/results/. Not a test: ``make bench-peers``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

import phi_torch_jit as ptj
from phi_torch_jit import _meter

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


def _phiml_cg() -> Callable[..., torch.Tensor]:
    """The same CG as a custom gradient of PhiML's torch backend (what its jit expects)."""
    from phiml.backend.torch import TORCH

    return TORCH.custom_gradient(cg, lambda x, y, dy: (-cg(-dy[0]),))  # type: ignore[no-any-return]


def step_a(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = advect(s, v)
    v = torch.cat([advect(v[:, i : i + 1], v) for i in range(2)], dim=1)
    v = v + DT * torch.cat([torch.zeros_like(s), 0.1 * s], dim=1)
    p = jacobi(divergence(v))
    return v - gradient(p), s


def make_step_b(solve: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    def step_b(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = advect(s, v)
        v = torch.cat([advect(v[:, i : i + 1], v) for i in range(2)], dim=1)
        v = v + DT * torch.cat([torch.zeros_like(s), 0.1 * s], dim=1)
        p = solve(divergence(v))
        return v - gradient(p), s

    return step_b


def make_training(net: nn.Module, solve: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    step_b = make_step_b(solve)

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


def max_rel_diff(a: Any, b: Any, scale_of: Any = None) -> float:
    """max |a - b| / max |b| over the outputs (NaN if a has NaN where b has not).

    ``scale_of``: outputs whose magnitudes give the scale instead of ``b``'s (at rest a loss is
    tiny, and rounding relative to it says nothing; the same workload's moving state is the
    meaningful scale)."""
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    scales = scale_of if isinstance(scale_of, tuple) else (scale_of,) * len(b)
    worst = 0.0
    for x, y, s in zip(a, b, scales):
        diff, scale = _abs_max(x, y)
        if s is not None:
            scale = max(scale, _abs_max(s, s)[1])
        if diff != diff:  # NaN
            return float("nan")
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def _abs_max(x: Any, y: Any) -> tuple[float, float]:
    """(max |x - y|, max |y|) for tensors or PhiFlow fields."""
    if isinstance(y, torch.Tensor):
        x, y = x.detach(), y.detach()
        return float((x - y).abs().max()), float(y.abs().max())
    from phiml import math

    return float(math.max(abs(x.values - y.values))), float(math.max(abs(y.values)))


_PEERS = ""
"""``--peers``: which peers run (all when empty)."""


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def _guarded(make: Callable[[], Any]) -> Any:
    try:
        return make()
    except Exception as error:
        return f"fails: {type(error).__name__}"


def peers(
    fn: Callable[..., Any], phiml_fn: Callable[..., Any] | None, example: tuple[Any, ...]
) -> dict[str, Any]:
    """Build each peer (lazily compiled ones compile at their first call)."""
    from phiml.backend.torch import TORCH

    result: dict[str, Any] = {
        "eager": fn,
        "ours (torchscript)": ptj.jit(fn, engine="torchscript"),
        "ours (compile)": ptj.jit(fn, engine="compile"),
        "ours (auto, the default)": ptj.jit(fn),
    }
    if phiml_fn is None:  # a PhiFlow function: PhiML's jit of PhiML values
        from phiml import math

        result["PhiML jit"] = math.jit_compile(fn)
        return result
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result["raw torch.jit.trace"] = _guarded(
            lambda: torch.jit.trace(fn, example, check_trace=False)
        )
    result["raw torch.compile"] = torch.compile(fn)
    result["PhiML jit"] = TORCH.jit_compile(phiml_fn)
    return result


def bench(
    name: str,
    fn: Callable[..., Any],
    phiml_fn: Callable[..., Any] | None,
    inputs: dict[str, tuple[Any, ...]],
    n: int,
    reps: int,
    grad: bool,
) -> list[dict[str, Any]]:
    def call(f: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        out = f(*args)
        if grad:
            out.backward()
        return out

    reference = {key: call(fn, args) for key, args in inputs.items()}
    chosen = [p for p in _PEERS.split(",") if p]
    chosen_peers = {peer: f for peer, f in peers(fn, phiml_fn, inputs["same"]).items()
                    if peer == "eager" or not chosen or any(c in peer for c in chosen)}  # fmt: skip
    rows = [_measure(name, n, peer, f, inputs, reference, call)
            for peer, f in chosen_peers.items()]  # fmt: skip
    _time_interleaved(rows, chosen_peers, lambda f: call(f, inputs["same"]), reps)
    eager = next(r["step_s"] for r in rows if r["peer"] == "eager")
    for r in rows:
        if "step_s" in r:
            r["ratio"] = r["step_s"] / eager
    return rows


def native_inputs(n: int, grad: bool) -> dict[str, tuple[torch.Tensor, ...]]:
    same, new = states(n, 0), states(n, 1)
    rest = (torch.zeros_like(same[0]), torch.zeros_like(same[1]))
    if grad:
        same = (same[0].requires_grad_(), same[1])
    return {"same": same, "new": new, "rest": rest}


def _pay_process_start_up() -> None:
    """Compile a small function once, in a throwaway cache directory, before measuring: the
    one-time costs of a process (inductor's imports, probing the C++ compiler and the CPU's
    vector instructions) then burden no peer's first call, whichever runs first."""
    with tempfile.TemporaryDirectory() as cache, temporary_cache_dir(cache):
        torch.compile(lambda x: torch.sin(x) * 2 + x.sum())(torch.randn(8))
        torch._dynamo.reset()


def _measure(
    name: str,
    n: int,
    peer: str,
    f: Any,
    inputs: dict[str, tuple[Any, ...]],
    reference: dict[str, Any],
    call: Callable[..., Any],
) -> dict[str, Any]:
    row: dict[str, Any] = {"workload": name, "N": n, "peer": peer}
    if isinstance(f, str):
        return {**row, "note": f}
    print(f"  {name} N={n}: {peer}", flush=True)
    with tempfile.TemporaryDirectory() as cache, temporary_cache_dir(cache):  # cold: see _measured
        return _measured(row, f, inputs, reference, call, peer)


def _measured(
    row: dict[str, Any],
    f: Any,
    inputs: dict[str, tuple[Any, ...]],
    reference: dict[str, Any],
    call: Callable[..., Any],
    peer: str,
) -> dict[str, Any]:
    """One peer's figures, measured in an empty inductor cache directory of its own, with
    inductor's in-memory caches cleared: every compiling peer's first call is a cold start
    (bench_warm_start.py measures warm ones)."""
    breaks = _graph_breaks()
    start = time.perf_counter()
    try:
        first = timed(lambda: call(f, inputs["same"]))
    except Exception as error:  # a peer that cannot run this workload
        return {**row, "note": f"fails: {type(error).__name__}"}
    row["graph_breaks"] = _graph_breaks() - breaks if "compile" in peer else None
    # A compile left for later calls (AOTAutograd's backward at the first backward, a dynamo
    # recompile) shows here; auto's second call only queues its background compile.
    row["second_call_s"] = timed(lambda: call(f, inputs["same"]))
    if isinstance(f, ptj.JitFunction) and f.engine.name == "auto":  # until the switch
        f.wait_compiled()
        row["ready_s"] = time.perf_counter() - start
        row["tier"] = next(line for line in f.explain().splitlines() if "tier:" in line).strip()
        print(f"    {row['tier']}", flush=True)
    for key, args in inputs.items():
        scale = reference["same"] if key == "rest" else None
        row[f"diff_{key}"] = max_rel_diff(call(f, args), reference[key], scale)
    if "ready_s" in row:  # inputs without requires_grad made another specialization: let its
        f.wait_compiled()  # background compile end, or it competes with the timed steps
    return {**row, "first_call_s": first}


def _time_interleaved(
    rows: list[dict[str, Any]], fns: dict[str, Any], step: Callable[[Any], Any], reps: int
) -> None:
    """Median step time of every peer that ran, with the peers' calls interleaved (one call of
    each per round), so that a drift in the machine's load burdens all peers alike."""
    running = [(r, fns[r["peer"]]) for r in rows if "first_call_s" in r]
    for _ in range(3):
        for _, f in running:
            step(f)
    # A jitted function's first calls measure its program against eager code (NOTE [never
    # slower than eager]): until that is decided, some of its calls run eagerly on purpose.
    for _, f in running:
        for _ in range(MEASURING_CALLS):
            if not isinstance(f, ptj.JitFunction) or _decided(f):
                break
            step(f)
    times: dict[str, list[float]] = {r["peer"]: [] for r, _ in running}
    for _ in range(reps):
        for r, f in running:
            times[r["peer"]].append(timed(lambda: step(f)))  # noqa: B023 (called at once)
    for r, _ in running:
        r["step_s"] = statistics.median(times[r["peer"]])


MEASURING_CALLS = 2 * (_meter.WARM_UP + 2 * _meter.SAMPLES)
"""At most this many untimed calls until a jitted function decided (a specialization other
calls made, for other inputs, is not called again and stays undecided)."""


def _decided(f: ptj.JitFunction) -> bool:
    """Whether every specialization of ``f`` finished measuring itself against eager."""
    meters = [s.meter for s in f.specializations if s.meter is not None]
    return all(m.done or m.eager_wins for m in meters)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | N | peer | first call | second call | step | ratio | graph breaks "
        "| rel. diff same | new | rest (scale of same) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['workload']} | {r['N']} | {r['peer']} "
        if "note" in r:
            lines.append(head + f"| {r['note']} | | | | | | | |")
            continue
        breaks = "" if r.get("graph_breaks") is None else str(r["graph_breaks"])
        lines.append(
            head + f"| {r['first_call_s']:.2f} s | {r['second_call_s']:.2f} s "
            f"| {r['step_s'] * 1e3:.2f} ms | {r['ratio']:.2f}x "
            f"| {breaks} | {r['diff_same']:.1e} | {r['diff_new']:.1e} | {r['diff_rest']:.1e} |"
        )
    return "\n".join(lines)


def targets(rows: list[dict[str, Any]]) -> str:
    """The targets of issue 5, each checked on the measured rows."""
    by = {(r["workload"], r["N"], r["peer"]): r for r in rows}
    lines = ["| target | workload | N | measured | met |", "|---|---|---|---|---|"]

    def add(target: str, workload: str, n: int, measured: str, met: bool) -> None:
        lines.append(f"| {target} | {workload} | {n} | {measured} | {'yes' if met else 'NO'} |")

    for (workload, n, peer), r in by.items():
        if "step_s" not in r:
            continue
        worst = max(r["diff_same"], r["diff_new"], r["diff_rest"])
        ok = worst <= 1e-4  # NaN compares False
        if peer.startswith("ours") or peer == "PhiML jit":
            add(f"rel. diff <= 1e-4 ({peer})", workload, n, f"{worst:.1e}", ok)
        phiml = by.get((workload, n, "PhiML jit"))
        if peer == "ours (torchscript)" and phiml and "step_s" in phiml:
            ratio = r["step_s"] / phiml["step_s"]
            add("torchscript step <= PhiML jit", workload, n, f"{ratio:.2f}x PhiML", ratio <= 1)
        if peer == "ours (torchscript)" and n == 32:
            first = r["first_call_s"]
            add("torchscript first call <= 0.5 s", workload, n, f"{first:.2f} s", first <= 0.5)
        raw = by.get((workload, n, "raw torch.compile"))
        if (
            peer not in ("ours (compile)", "ours (auto, the default)")
            or not raw
            or "step_s" not in raw
        ):
            continue
        name = peer[6:-1]
        speed = raw["step_s"] / r["step_s"]
        if workload.startswith("(a)"):
            add(f"{name} within 1.1x of raw torch.compile", workload, n,
                f"{1 / speed:.2f}x raw", 1 / speed <= 1.1)  # fmt: skip
        else:
            if name == "compile":
                add("compile: 0 graph breaks", workload, n, str(r["graph_breaks"]),
                    r["graph_breaks"] == 0)  # fmt: skip
            add(f"{name} >= 1.5x faster than raw torch.compile", workload, n,
                f"{speed:.2f}x faster", speed >= 1.5)  # fmt: skip
        add(f"{name} first call <= raw torch.compile's", workload, n,
            f"{r['first_call_s']:.1f} s vs {raw['first_call_s']:.1f} s",
            r["first_call_s"] <= raw["first_call_s"])  # fmt: skip
        if "ready_s" in r:
            add(
                "auto: compiled tier reached (s, caller never blocked)",
                workload,
                n,
                f"{r['ready_s']:.1f} s",
                True,
            )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["workload"], r["N"]) for r in rows))
    names = [p for p in dict.fromkeys(r["peer"] for r in rows) if p != "eager"]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(groups)), 4.5))
    width = 0.8 / len(names)
    for k, peer in enumerate(names):
        ratios = [
            next((r.get("ratio", float("nan")) for r in rows
                  if (r["workload"], r["N"], r["peer"]) == (*g, peer)), float("nan"))
            for g in groups
        ]  # fmt: skip
        ax.bar([i + k * width for i in range(len(groups))], ratios, width, label=peer)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{w.split(',')[0]}\nN={n}" for w, n in groups])
    ax.set_yscale("log")
    ax.set_ylabel("step time / eager (lower is faster)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def phiflow_inputs(n: int) -> tuple[Callable[..., Any], dict[str, tuple[Any, ...]]]:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "demos"))
    from smoke_plume import initial_state, make_step

    v, s, inflow = initial_state(n)
    step = make_step(inflow)
    same = (v, s)
    for _ in range(3):
        same = step(*same)
    new = step(*same)
    return step, {"same": same, "new": new, "rest": (v * 0, s * 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--workloads", default="abcd", help="subset of abcd (default all)")
    parser.add_argument("--peers", default="", help="comma-separated substrings of peer names "
                        "to run besides eager (default: all)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    global _PEERS
    _PEERS = args.peers
    _pay_process_start_up()
    # Raw torch.compile compiles each size with static shapes, as in a process that runs one
    # size. By default dynamo recompiles the same function's second size with dynamic shapes
    # and reuses that code for the third: a first call of 0.03 s at N=512, steps 1.4x slower.
    torch._dynamo.config.automatic_dynamic_shapes = False
    warnings.filterwarnings("ignore")  # PhiML notices, torch.jit deprecations of the peers
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 8, 3, padding=1, padding_mode="circular"), nn.Tanh(),
                        nn.Conv2d(8, 2, 3, padding=1, padding_mode="circular"))  # fmt: skip
    phiml_cg = _phiml_cg()
    rows: list[dict[str, Any]] = []
    for n in args.sizes:
        reps = args.reps if n < 512 else max(3, args.reps // 3)
        if "a" in args.workloads:
            rows += bench("(a) smoke, Jacobi", step_a, step_a, native_inputs(n, False), n,
                          reps, grad=False)  # fmt: skip
        if "b" in args.workloads:
            rows += bench("(b) smoke, CG custom fn", make_step_b(cg_solve), make_step_b(phiml_cg),
                          native_inputs(n, False), n, reps, grad=False)  # fmt: skip
        if "c" in args.workloads:
            rows += bench("(c) training, 4 steps + CNN", make_training(net, cg_solve),
                          make_training(net, phiml_cg), native_inputs(n, True), n, reps,
                          grad=True)  # fmt: skip
        if "d" in args.workloads and n < 512:  # PhiFlow eager at 512: minutes per step here
            step, inputs = phiflow_inputs(n)
            rows += bench("(d) PhiFlow smoke plume", step, None, inputs, n, reps, grad=False)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peers.json").write_text(json.dumps(rows, indent=2))
    header = f"torch {torch.__version__}, {torch.get_num_threads()} threads, medians of {args.reps}"
    text = f"{header}\n\n{table(rows)}\n\nTargets:\n\n{targets(rows)}\n"
    (args.out / "peers.md").write_text(text)
    plot(rows, args.out / "peers.png")
    print(text)


if __name__ == "__main__":
    main()
