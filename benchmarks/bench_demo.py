"""Benchmark the demo step: eager vs phi_torch_jit, side by side in one process.

Measures, per grid size,

* first call of a fresh jitted step (record + compile custom functions + trace);
* median time of one forward step;
* median time of a training iteration: 4 unrolled steps, loss, backward;
* max |eager - jit| of 4 steps from the same state.

Eager and jit calls are interleaved within each repetition so that machine
noise hits both alike; ratios are jit / eager. Writes JSON and a markdown
table to ``benchmarks/results/`` and prints the table. Not a test.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "demos"))

from diffusion_cg import Source, initial_state, make_step, rollout

import phi_torch_jit as ptj

WARMUP = 3
"""Untimed calls after the first (their total is reported as warmup_calls_s)."""
SETTLE = 30
"""Untimed calls after the background compile, twice (past the meter's round)."""


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _train_iteration(step: Callable[..., Any], u: torch.Tensor, k: torch.Tensor) -> None:
    loss = (rollout(step, u, k, 4) ** 2).mean()
    loss.backward()


def bench_size(n: int, reps: int, engine: str | None) -> dict[str, float]:
    torch.manual_seed(0)
    source = Source()
    eager = make_step(source)
    u = initial_state(n)
    k = torch.tensor(0.5)
    jitted = (
        ptj.jit(make_step(source)) if engine is None else ptj.jit(make_step(source), engine=engine)
    )
    first = _timed(lambda: jitted(u, k))
    # TorchScript's profiling executor optimizes a graph during its first few runs.
    warmup = sum(_timed(lambda: jitted(u, k)) for _ in range(WARMUP))
    u_train = u.clone().requires_grad_()
    first_train = _timed(lambda: _train_iteration(jitted, u_train, k))
    for _ in range(WARMUP):
        _train_iteration(jitted, u_train, k)
        _train_iteration(eager, u_train, k)
    # The default engine compiles in the background from a signature's third call, then
    # measures its program against eager code for a round (25 calls): timed after both.
    for _ in range(2):
        jitted.wait_compiled()
        for _ in range(SETTLE):
            jitted(u, k)
            _train_iteration(jitted, u_train, k)
    with torch.no_grad():
        diff = float((rollout(eager, u, k, 4) - rollout(jitted, u, k, 4)).abs().max())
    times: dict[str, list[float]] = {"eager": [], "jit": [], "eager_train": [], "jit_train": []}
    for _ in range(reps):
        times["eager"].append(_timed(lambda: eager(u, k)))
        times["jit"].append(_timed(lambda: jitted(u, k)))
        times["eager_train"].append(_timed(lambda: _train_iteration(eager, u_train, k)))
        times["jit_train"].append(_timed(lambda: _train_iteration(jitted, u_train, k)))
    med = {name: statistics.median(values) for name, values in times.items()}
    return {
        "size": n,
        "first_call_s": first,
        "warmup_calls_s": warmup,
        "first_train_iteration_s": first_train,
        "eager_step_s": med["eager"],
        "jit_step_s": med["jit"],
        "step_ratio": med["jit"] / med["eager"],
        "eager_train_s": med["eager_train"],
        "jit_train_s": med["jit_train"],
        "train_ratio": med["jit_train"] / med["eager_train"],
        "max_abs_diff": diff,
        "num_traces": jitted.num_traces,
    }


def table(rows: list[dict[str, float]]) -> str:
    lines = [
        "| N | first call | next 3 calls | eager step | jit step | ratio | eager train it. "
        "| jit train it. | ratio | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size']} | {r['first_call_s'] * 1e3:.0f} ms "
            f"| {r['warmup_calls_s'] * 1e3:.0f} ms | {r['eager_step_s'] * 1e3:.2f} ms "
            f"| {r['jit_step_s'] * 1e3:.2f} ms | {r['step_ratio']:.2f}x "
            f"| {r['eager_train_s'] * 1e3:.1f} ms | {r['jit_train_s'] * 1e3:.1f} ms "
            f"| {r['train_ratio']:.2f}x | {r['max_abs_diff']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--engine", default=None, help="default: the library's default")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    rows = [bench_size(n, args.reps, args.engine) for n in args.sizes]
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "engine": args.engine,
        "reps": args.reps,
    }
    (args.out / "demo.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    text = table(rows)
    (args.out / "demo.md").write_text(text + "\n")
    engine = args.engine or "default"
    print(f"torch {meta['torch']}, {meta['threads']} threads, engine {engine!r}", end="")
    print(f", medians of {args.reps}")
    print(text)


if __name__ == "__main__":
    main()
