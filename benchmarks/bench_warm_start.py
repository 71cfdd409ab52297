"""Warm start: a second process reaching the inductor tier through inductor's on-disk caches.

For workloads (a)-(c) of bench_peers (N=32), each measured in a fresh Python process, first
with an empty cache directory (cold), then again with the directory the first run filled
(warm). Engine "compile": the first call (record, capture, inductor compile). Engine "auto":
the time until ``wait_compiled()`` returns after the second call, i.e. until calls run on the
inductor tier. Not a test: ``make bench-warm-start``; writes benchmarks/results/warm_start.md.

Inductor's caches are keyed by the captured graph, which names our custom ops
(``phi_torch_jit::cg_pressure_0``): the names are the custom function's name and a counter
per process, so a program that creates its jitted functions in the same order gets the same
names, and the same keys.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, sys, time, torch
sys.path.insert(0, {bench_dir!r})
import bench_peers as bp
import phi_torch_jit as ptj
from torch import nn
workload, engine = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
net = nn.Sequential(nn.Conv2d(2, 8, 3, padding=1, padding_mode="circular"), nn.Tanh(),
                    nn.Conv2d(8, 2, 3, padding=1, padding_mode="circular"))
fn, grad = {{"a": (bp.step_a, False), "b": (bp.make_step_b(bp.cg_solve), False),
             "c": (bp.make_training(net, bp.cg_solve), True)}}[workload]
inputs = bp.native_inputs(32, grad)["same"]
def call(f):
    out = f(*inputs)
    if grad:
        out.backward()
jitted = ptj.jit(fn, engine=engine)
start = time.perf_counter()
call(jitted)
first = time.perf_counter() - start
if engine == "auto":
    call(jitted)
    jitted.wait_compiled()
ready = time.perf_counter() - start
print(json.dumps({{"first_call_s": first, "ready_s": ready}}))
"""


def run(workload: str, engine: str, cache: Path) -> dict[str, float]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    code = CHILD.format(bench_dir=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", code, workload, engine], env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="abc")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    lines = [
        "| workload | engine | cold: first call | cold: inductor tier after | warm: first call "
        "| warm: inductor tier after |",
        "|---|---|---|---|---|---|",
    ]
    for workload in args.workloads:
        for engine in ("compile", "auto"):
            with tempfile.TemporaryDirectory() as cache:
                start = time.perf_counter()
                cold = run(workload, engine, Path(cache))
                warm = run(workload, engine, Path(cache))
            lines.append(
                f"| ({workload}) | {engine} | {cold['first_call_s']:.2f} s | "
                f"{cold['ready_s']:.2f} s | {warm['first_call_s']:.2f} s | "
                f"{warm['ready_s']:.2f} s |"
            )
            print(lines[-1], f"({time.perf_counter() - start:.0f} s)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines) + "\n"
    (args.out / "warm_start.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
