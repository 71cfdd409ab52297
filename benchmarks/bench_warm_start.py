"""Warm start: a second process of the same script, served by inductor's caches.

For the main demo's smoke plume step (``demo``, 32x32 as ``make demo`` runs it) and workloads
(a)-(c) of bench_peers (N=32), each measured in fresh Python processes: first with an empty
cache directory (cold), then again with the directory the first run filled (warm), for the
default engine and engine "compile", and once for engine "torchscript" (which keeps nothing
on disk: its first call is the same cold or warm). Per process: making the jitted function
(``ptj.jit(fn)``: before session 41 the default engine imported inductor there, 1-2 s that no
column showed), the first call, the second,
the median of the first 12 steps (no warm-up discarded) and the steady step after
``wait_compiled()``. Not a test: ``make bench-warm-start``; writes
benchmarks/results/warm_start.md.

Inductor's caches are keyed by the captured graph, which names our custom ops
(``phi_torch_jit::cg_pressure_0``): the names are the custom function's name and a counter
per process, so a program that creates its jitted functions in the same order gets the same
names, and the same keys. The default engine remembers which graphs inductor compiled
(``engines/_warm_starts.py``) and loads those after the first call.
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
import json, statistics, sys, time, torch
sys.path.insert(0, {bench_dir!r})
sys.path.insert(0, {demo_dir!r})
import phi_torch_jit as ptj
from torch import nn
workload, engine = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
grad = workload == "c"
if workload == "demo":
    import smoke_plume
    v, s, inflow = smoke_plume.initial_state(32)
    fn, inputs = smoke_plume.make_step(inflow), (v, s)
else:
    import bench_peers as bp
    net = nn.Sequential(nn.Conv2d(2, 8, 3, padding=1, padding_mode="circular"), nn.Tanh(),
                        nn.Conv2d(8, 2, 3, padding=1, padding_mode="circular"))
    fn = {{"a": bp.step_a, "b": bp.make_step_b(bp.cg_solve),
           "c": bp.make_training(net, bp.cg_solve)}}[workload]
    inputs = bp.native_inputs(32, grad)["same"]
def call(f):
    out = f(*inputs)
    if grad:
        out.backward()
start = time.perf_counter()  # making it: the default engine imported inductor here (1-2 s)
jitted = ptj.jit(fn) if engine == "default" else ptj.jit(fn, engine=engine)
made = time.perf_counter() - start
times = []
for _ in range(12):
    start = time.perf_counter()
    call(jitted)
    times.append(time.perf_counter() - start)
jitted.wait_compiled()
steady = []
for _ in range(12):
    start = time.perf_counter()
    call(jitted)
    steady.append(time.perf_counter() - start)
print(json.dumps({{"jit": made, "first": times[0], "second": times[1],
                   "median12": statistics.median(times), "steady": statistics.median(steady)}}))
"""


HASH_SEED = "0"


def run(workload: str, engine: str, cache: Path) -> dict[str, float]:
    # PhiML orders some dimensions by Python's string hashes, which differ per process unless
    # PYTHONHASHSEED is set: the demo's captured graph, and so every cache key, would differ
    # between two processes about half the time (docs/engines.md, "Warm start").
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONHASHSEED": HASH_SEED}
    here = Path(__file__).resolve().parent
    code = CHILD.format(bench_dir=str(here), demo_dir=str(here.parent / "demos"))
    done = subprocess.run([sys.executable, "-c", code, workload, engine], env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _ms(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 0.1 else f"{seconds * 1e3:.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="demo,a,b,c", help="comma-separated")
    parser.add_argument("--engines", default="default,compile")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    lines = [
        "| workload | engine | start | jit() | first call | second call | median of the first 12 "
        "| steady step |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def row(workload: str, engine: str, start: str, got: dict[str, float]) -> None:
        lines.append(
            f"| ({workload}) | {engine} | {start} | {_ms(got['jit'])} | {_ms(got['first'])} "
            f"| {_ms(got['second'])} | "
            f"{_ms(got['median12'])} | {_ms(got['steady'])} |"
        )
        print(lines[-1], flush=True)

    for workload in args.workloads.split(","):
        with tempfile.TemporaryDirectory() as cache:
            row(workload, "torchscript", "any", run(workload, "torchscript", Path(cache)))
        for engine in args.engines.split(","):
            with tempfile.TemporaryDirectory() as cache:
                start = time.perf_counter()
                row(workload, engine, "cold", run(workload, engine, Path(cache)))
                row(workload, engine, "warm", run(workload, engine, Path(cache)))
            print(f"({time.perf_counter() - start:.0f} s)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines) + "\n"
    (args.out / "warm_start.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
