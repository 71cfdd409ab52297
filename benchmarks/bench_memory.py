"""Resident memory over 10,000 calls of a compiled training step (issue 6).

After a warm-up, runs the demo's jitted step (CG custom function + CNN) with
backward 10,000 times and reports resident memory (RSS from /proc) at
checkpoints and the growth after warm-up. Not a test; the test suite guards
the trend with a shorter run.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "demos"))

from diffusion_cg import Source, initial_state, make_step

import phi_torch_jit as ptj


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--size", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    step = ptj.jit(make_step(Source()))
    u = initial_state(args.size).requires_grad_()
    k = torch.tensor(0.5)
    for _ in range(args.warmup):
        step(u, k).sum().backward()
    gc.collect()
    start = rss_mib()
    print(f"after {args.warmup} warm-up calls: {start:.1f} MiB")
    for i in range(1, args.calls + 1):
        step(u, k).sum().backward()
        if i % (args.calls // 5) == 0:
            gc.collect()
            print(f"after {i} more calls: {rss_mib():.1f} MiB")
    growth = rss_mib() - start
    print(f"growth after warm-up: {growth:+.1f} MiB ({100 * growth / start:+.2f} %)")


if __name__ == "__main__":
    main()
