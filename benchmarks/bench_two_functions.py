"""A second jitted function met while the first one's background compile runs, one process.

Engine ``"auto"`` compiles on one background thread that holds the tracing lock for a whole
compile, except while inductor's C++ compiler runs, when it lends it; a capture on the
caller's thread only *tries* that lock, so a new function (or a new signature) met meanwhile
runs eagerly until a build lends the lock or the compile ends (docs/engines.md, "Several
jitted functions"). This measures how long: the first function is a PhiFlow heat step
(``tests/phiflow_programs.heat``, 64x64, CG solve), called three times so that its compile is
queued; the second is bench-peers' (a), the Jacobi smoke step at N=32, called in a loop until
it has a trace (``--second``: a PhiFlow step at 32 instead, its CG blocks compiled on the
caller's thread). Each run uses an empty inductor cache directory of its own (a cold compile).

Reported per run: the first function's compile (seconds from its third call until its
compile thread went idle), the seconds and calls until the second function was captured, the
second's median step before that (eager, beside the compile) and after the compile, and its
result's largest difference to eager's. Not a test: numbers vary with the machine's load.
``--runs`` repeats it.
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
from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import bench_peers
from phi.torch.flow import math
from phiflow_programs import PROGRAMS

import phi_torch_jit as ptj

LIMIT_S = 300.0
"""The second function's loop gives up after this long."""


def _second(name: str) -> tuple[Any, tuple[Any, ...], Callable[[Any, Any], float]]:
    """The second function, its arguments, and the largest difference of two results."""
    if name == "peers-a":
        v, s = bench_peers.states(32, 0)
        return (
            bench_peers.step_a,
            (v, s),
            lambda a, b: max(float((x - y).abs().max()) for x, y in zip(a, b)),
        )
    step, state = PROGRAMS[name](32)
    return step, tuple(step(*state)), _max_diff


def _max_diff(a: tuple[Any, ...], b: tuple[Any, ...]) -> float:
    fields = [(x, y) for x, y in zip(a, b) if hasattr(x, "values")]
    return max(float(math.max(abs(x.values - y.values))) for x, y in fields)


def run_once(second_name: str) -> dict[str, Any]:
    step, state = PROGRAMS["heat"](64)
    state = step(*state)
    first = ptj.jit(step)
    fn, args, difference = _second(second_name)
    second = ptj.jit(fn)
    for _ in range(3):  # the third call queues the first function's compile
        first(*state)
    queued = time.perf_counter()
    before: list[float] = []
    while second.num_traces == 0 and time.perf_counter() - queued < LIMIT_S:
        start = time.perf_counter()
        second(*args)
        before.append(time.perf_counter() - start)
    captured_s = time.perf_counter() - queued
    ptj.wait_compiled()
    compile_s = time.perf_counter() - queued
    for _ in range(40):  # past the second function's own compile and its meter
        second(*args)
    ptj.wait_compiled()
    after = []
    for _ in range(200):
        start = time.perf_counter()
        second(*args)
        after.append(time.perf_counter() - start)
    return {
        "first_compile_s": compile_s,
        "second_captured_after_s": captured_s,
        "second_eager_calls": len(before) - 1 if second.num_traces else len(before),
        "second_before_ms": 1e3 * statistics.median(before) if before else float("nan"),
        "second_after_ms": 1e3 * statistics.median(after),
        "difference": difference(second(*args), fn(*args)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument(
        "--second",
        default="peers-a",
        choices=("peers-a", "burgers", "reaction_diffusion", "obstacle_flow"),
        help="the second function: bench-peers (a) at N=32, or a PhiFlow step at 32",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # PhiML's sparse-CSR beta notice, deprecations
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        f"second function: {args.second}\n"
        "| run | first function's compile | second captured after | its eager calls "
        "| its step before / after | its result vs eager |\n|---|---|---|---|---|---|"
    )
    for n in range(args.runs):
        with tempfile.TemporaryDirectory() as cache, temporary_cache_dir(cache):
            r = run_once(args.second)
        print(
            f"| {n} | {r['first_compile_s']:.1f} s | {r['second_captured_after_s']:.1f} s "
            f"| {r['second_eager_calls']} | {r['second_before_ms']:.2f} / "
            f"{r['second_after_ms']:.3f} ms | {r['difference']:.1e} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
