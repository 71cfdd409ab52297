"""Steps served while the default engine's background compile runs, against eager's steps.

Issue 34, item 5: "while it runs, served steps stay within 1.3x of eager". Per workload, in
one process with an empty inductor cache directory of its own (a cold compile): 30 eager
steps, then the jitted step called in a loop from its first call until ``wait_compiled(0)``
says the compile is done, then 50 steps after it. Reported: the eager median, the median and
90th percentile of the steps served during the compile (fast tier, meter samples and all;
the first three calls, which queue the compile, left out) as ratios to eager's median, how
many there were, how long the compile took, and the median step after it.

Workloads: bench-peers (a) Jacobi smoke step, (b) CG custom-function step and (c) training
iteration (forward and backward) at N=32, and PhiFlow's heat step at 128x128
(``tests/phiflow_programs.heat``). Not a test: numbers vary with the machine's load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import bench_peers

import phi_torch_jit as ptj

WORKLOADS = ("a", "b", "c", "heat")


def _workload(name: str) -> tuple[Callable[..., Any], Callable[..., Any], tuple[Any, ...]]:
    """(eager step, jitted step, arguments)."""
    if name == "a":
        return bench_peers.step_a, ptj.jit(bench_peers.step_a), bench_peers.states(32, 0)
    if name == "b":
        step = bench_peers.make_step_b(bench_peers.cg_solve)
        return step, ptj.jit(step), bench_peers.states(32, 0)
    if name == "c":
        torch.manual_seed(0)
        net = nn.Sequential(
            nn.Conv2d(2, 8, 3, padding=1, padding_mode="circular"),
            nn.Tanh(),
            nn.Conv2d(8, 2, 3, padding=1, padding_mode="circular"),
        )
        loss = bench_peers.make_training(net, bench_peers.cg_solve)
        v, s = bench_peers.states(32, 0)
        return _with_backward(loss), _with_backward(ptj.jit(loss)), (v.requires_grad_(), s)
    from phiflow_programs import PROGRAMS

    step, state = PROGRAMS["heat"](128)
    return step, ptj.jit(step), tuple(step(*state))


def _with_backward(loss: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def iteration(*args: Any) -> torch.Tensor:
        value = loss(*args)
        value.backward()
        return value

    return iteration


def _times(fn: Callable[..., Any], args: tuple[Any, ...], n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn(*args)
        out.append(time.perf_counter() - start)
    return out


def run(name: str) -> dict[str, float]:
    eager, jitted, args = _workload(name)
    eager_s = statistics.median(_times(eager, args, 30))
    for _ in range(3):  # the record pass, the fast tier; the third call queues the compile
        jitted(*args)
    start, during = time.perf_counter(), []
    while not ptj.wait_compiled(0):
        during += _times(jitted, args, 1)
    compile_s = time.perf_counter() - start
    after = statistics.median(_times(jitted, args, 50))
    deciles = statistics.quantiles(during, n=10) if len(during) > 1 else during * 9
    return {
        "eager_ms": 1e3 * eager_s,
        "median": statistics.median(during) / eager_s if during else float("nan"),
        "p90": deciles[-1] / eager_s if during else float("nan"),
        "steps": len(during),
        "compile_s": compile_s,
        "after": after / eager_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # PhiML's sparse-CSR beta notice, deprecations
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        "| workload | eager step | during the compile: median / 90th percentile | steps "
        "| compile | after |\n|---|---|---|---|---|---|"
    )
    for name in args.workloads:
        with tempfile.TemporaryDirectory() as cache, temporary_cache_dir(cache):
            r = run(name)
        print(
            f"| {name} | {r['eager_ms']:.2f} ms | {r['median']:.2f}x / {r['p90']:.2f}x "
            f"| {r['steps']:.0f} | {r['compile_s']:.1f} s | {r['after']:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
