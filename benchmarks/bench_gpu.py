"""Device-agnostic step times: the peers on CUDA where there is one, on the CPU otherwise.

Workloads (bench_peers.py's): (a) smoke step with 30 Jacobi iterations, (b) the same with a CG
custom function (a data-dependent loop: captured as blocks on engines compile/auto), (c) a
training iteration (4 steps of (b) plus a CNN, backward), and the PhiFlow smoke plume step of
demos/smoke_plume.py at 64 and 128 (``--phiflow``).

Peers: eager; ours with engines "torchscript", "compile", "auto", and "compile" with
``mode="reduce-overhead"`` (CUDA graphs; custom ops that read values on the host split the
graph, docs/gpu.md); raw ``torch.compile`` (default and ``"reduce-overhead"``); PhiML's torch
jit. Timing synchronizes the device around each call; the peers' calls are interleaved; medians
and ratios to eager from one run. A peer that fails says so in its cell. Not a test:
``python benchmarks/bench_gpu.py [--device cuda] [--sizes 128] [--phiflow]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_peers as peers_bench

import phi_torch_jit as ptj

PEERS = ""  # --peers: which peers run (all when empty)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peers(fn: Callable[..., Any], phiml_fn: Callable[..., Any] | None) -> dict[str, Any]:
    result: dict[str, Any] = {
        "eager": fn,
        "ours (torchscript)": ptj.jit(fn, engine="torchscript"),
        "ours (compile)": ptj.jit(fn, engine="compile"),
        "ours (auto, the default)": ptj.jit(fn),
        "ours (compile, reduce-overhead)": ptj.jit(fn, engine="compile", mode="reduce-overhead"),
    }
    if phiml_fn is None:  # a PhiFlow step: PhiML's own jit of PhiML values
        from phiml import math

        result["PhiML jit"] = math.jit_compile(fn)
        return result
    from phiml.backend.torch import TORCH

    result["raw torch.compile"] = torch.compile(fn)
    result["raw torch.compile, reduce-overhead"] = torch.compile(fn, mode="reduce-overhead")
    result["PhiML jit"] = TORCH.jit_compile(phiml_fn)
    return result


def _bench(
    name: str,
    fn: Callable[..., Any],
    phiml_fn: Callable[..., Any] | None,
    args: tuple[Any, ...],
    device: torch.device,
    reps: int,
    grad: bool,
) -> list[str]:
    def call(f: Callable[..., Any]) -> Any:
        out = f(*args)
        if grad:
            out.backward()
        return out

    running: dict[str, Any] = {}
    cells: dict[str, str] = {}
    wanted = [name for name in PEERS.split(",") if name]
    peers = {p: f for p, f in _peers(fn, phiml_fn).items() if not wanted or p == "eager"
             or any(w in p for w in wanted)}  # fmt: skip
    for peer, f in peers.items():
        try:
            for _ in range(3):  # first call (compile), a second (backward compiles), warm
                call(f)
            if isinstance(f, ptj.JitFunction):
                f.wait_compiled()
                call(f)
                for _ in range(peers_bench.MEASURING_CALLS):  # past measuring against eager
                    if peers_bench._decided(f):
                        break
                    call(f)
            _sync(device)
            running[peer] = f
        except Exception as error:  # a peer that cannot run this workload
            message = (str(error).splitlines() or [""])[0][:60]
            cells[peer] = f"fails: {type(error).__name__}: {message}"
            torch._dynamo.reset()
        print(f"  {name}: {peer} {'ready' if peer in running else cells[peer]}", flush=True)
    times: dict[str, list[float]] = {peer: [] for peer in running}
    for _ in range(reps):
        for peer, f in running.items():
            _sync(device)
            start = time.perf_counter()
            call(f)
            _sync(device)
            times[peer].append(time.perf_counter() - start)
    eager = statistics.median(times["eager"])
    for peer, samples in times.items():
        median = statistics.median(samples)
        cells[peer] = f"{median * 1e3:.2f} ms ({median / eager:.2f}x)"
    rows = [f"| {name} | {peer} | {cell} |" for peer, cell in cells.items()]
    print("\n".join(rows), flush=True)  # as each workload ends: a run cut short keeps them
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", type=int, nargs="+", default=[128])
    parser.add_argument("--workloads", default="abc", help="subset of abc")
    parser.add_argument("--phiflow", action="store_true", help="also the PhiFlow smoke step")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--peers", default="", help="comma-separated substrings of peer names")
    args = parser.parse_args()
    global PEERS
    PEERS = args.peers
    device = torch.device(args.device)
    torch.set_default_device(device)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 8, 3, padding=1, padding_mode="circular"), nn.Tanh(),
                        nn.Conv2d(8, 2, 3, padding=1, padding_mode="circular"))  # fmt: skip
    phiml_cg = peers_bench._phiml_cg()
    rows: list[str] = []
    for n in args.sizes:
        with torch.device("cpu"):  # its generator is the CPU's
            v, s = (t.to(device) for t in peers_bench.states(n, 0))
        if "a" in args.workloads:
            rows += _bench(f"(a) Jacobi smoke N={n}", peers_bench.step_a, peers_bench.step_a,
                           (v, s), device, args.reps, grad=False)  # fmt: skip
        if "b" in args.workloads:
            step_b = peers_bench.make_step_b(peers_bench.cg_solve)
            rows += _bench(f"(b) CG smoke N={n}", step_b, peers_bench.make_step_b(phiml_cg),
                           (v, s), device, args.reps, grad=False)  # fmt: skip
        if "c" in args.workloads:
            training = peers_bench.make_training(net, peers_bench.cg_solve)
            phiml_training = peers_bench.make_training(net, phiml_cg)
            state = (v.clone().requires_grad_(), s)
            rows += _bench(f"(c) training N={n}", training, phiml_training, state, device,
                           args.reps, grad=True)  # fmt: skip
    if args.phiflow:
        from phiml.backend.torch import TORCH

        TORCH.set_default_device(TORCH.list_devices("GPU" if device.type == "cuda" else "CPU")[0])
        for n in (64, 128):
            step, inputs = peers_bench.phiflow_inputs(n)
            rows += _bench(f"PhiFlow smoke {n}x{n}", step, None, inputs["same"], device,
                           max(3, args.reps // 3), grad=False)  # fmt: skip
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\ntorch {torch.__version__}, {name}, medians of {args.reps}, ratio to eager\n")
    print("| workload | peer | step |\n|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
