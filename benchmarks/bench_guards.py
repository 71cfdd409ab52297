"""Per-call cost of guards: module guards (issue 3), value guards (issue 6), Python reads.

Module guards: a jitted step calls a small CNN with N modules; guard_hooks=True
vs False vs eager, plus the guard check alone (ModuleGuard.holds). Value
guards: a function that branches on a tensor value (one guard) vs the same
arithmetic without the branch. Python reads: a step reading 20 Python values
(12 globals, 6 closure variables, a config dict, a list) vs the same step with
the values baked as literals (no reads), plus the check alone (PythonGuard.holds).
Variants are interleaved within each repetition; medians of per-call times are
reported. Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import phi_torch_jit as ptj


def make_net(blocks: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()]
    return nn.Sequential(*layers).eval()


def per_call(fn: Callable[[], Any], inner: int) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - start) / inner


def medians(variants: dict[str, tuple[Callable[[], Any], int]], reps: int) -> dict[str, float]:
    """Median microseconds per call of each variant, interleaved within each repetition."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, (fn, count) in variants.items():
            times[name].append(per_call(fn, count))
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 5, 20])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--inner", type=int, default=200)
    args = parser.parse_args()
    x = torch.randn(1, 4, 8, 8)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, medians of {args.reps}")
    print(
        "| modules | eager | jit, guard_hooks=False | jit, guard_hooks=True "
        "| full guard alone | training-only guard alone |"
    )
    print("|---|---|---|---|---|---|")
    for blocks in args.blocks:
        n, med = bench(blocks, x, args.reps, args.inner)
        print(
            f"| {n} | {med['eager']:.1f} us | {med['light']:.1f} us "
            f"| {med['guarded']:.1f} us | {med['guard']:.2f} us | {med['light_guard']:.2f} us |"
        )
    reads = bench_python_reads(args.reps, args.inner)
    print(
        f"\nPython reads: {reads['n']:.0f} values guarded, check alone {reads['guard']:.2f} us; "
        f"jitted step {reads['reading']:.1f} us per call vs {reads['baked']:.1f} us for the same "
        f"step with literals ({reads['reading'] - reads['baked']:+.1f} us)"
    )
    paths = bench_attribute_paths(args.reps, args.inner)
    print(
        f"\nAttribute paths: a step reading 20 paths (cfg.a*, cfg.sub.b*, CONFIG['s']['k*']), "
        f"{paths['n']:.0f} reads guarded, check alone {paths['guard']:.2f} us; jitted step "
        f"{paths['reading']:.1f} us per call"
    )
    value = bench_value_guard(args.reps, args.inner)
    print(
        f"\nValue guard: a guarded Python branch {value['guarded']:.1f} us per call vs "
        f"{value['unguarded']:.1f} us for the same branch with torch.where "
        f"({value['guarded'] - value['unguarded']:+.1f} us)"
    )


def bench(blocks: int, x: torch.Tensor, reps: int, inner: int) -> tuple[int, dict[str, float]]:
    """(number of guarded modules, median microseconds per call of each variant)."""
    net = make_net(blocks)
    guarded = ptj.jit(lambda u: net(u))
    light = ptj.jit(lambda u: net(u), guard_hooks=False)
    with torch.no_grad():
        for _ in range(5):
            guarded(x), light(x)
        guard = guarded.specializations[0].guard
        light_guard = light.specializations[0].guard
        assert guard is not None and light_guard is not None
        variants: dict[str, tuple[Callable[[], Any], int]] = {
            "eager": (lambda: net(x), inner),
            "light": (lambda: light(x), inner),
            "guarded": (lambda: guarded(x), inner),
            "guard": (guard.holds, inner * 10),
            "light_guard": (light_guard.holds, inner * 10),
        }
        result = medians(variants, reps)
    return len(guard.modules), result


_READS = "\n".join(
    [
        *(f"G{i} = {0.1 * i}" for i in range(12)),
        "CONFIG = {'scale': 2.0, 'mode': 'a'}",
        "LEVELS = [1, 2, 3]",
        "def make(" + ", ".join(f"c{i}" for i in range(6)) + "):",
        "    def step(u):",
        "        s = " + " + ".join([*(f"G{i}" for i in range(12)), *(f"c{i}" for i in range(6))]),
        "        return u * s * CONFIG['scale'] + LEVELS[0]",
        "    return step",
        "def make_baked():",
        "    def step(u):",
        "        return u * 12.6 * 2.0 + 1",
        "    return step",
    ]
)


def bench_python_reads(reps: int, inner: int) -> dict[str, float]:
    """Median microseconds per call of a step reading 20 Python values vs literals."""
    namespace: dict[str, Any] = {"__name__": "bench_reads"}
    exec(compile(_READS, __file__, "exec"), namespace)  # user code (this file)
    reading = ptj.jit(namespace["make"](*range(6)))
    baked = ptj.jit(namespace["make_baked"]())
    x = torch.randn(16)
    for jitted in (reading, baked):  # a compile still running (the module guards' functions)
        for _ in range(200):  # blocks their traces: their calls run eagerly until it is done
            jitted(x)
            jitted.wait_compiled()
            if jitted.specializations:
                break
            time.sleep(0.05)
    guard = reading.specializations[0].python_guard
    assert guard is not None
    variants: dict[str, tuple[Callable[[], Any], int]] = {
        "reading": (lambda: reading(x), inner),
        "baked": (lambda: baked(x), inner),
        "guard": (guard.holds, inner * 10),
    }
    result = medians(variants, reps)
    result["n"] = float(len(guard))
    return result


_PATHS = "\n".join(
    [
        "from types import SimpleNamespace",
        "cfg = SimpleNamespace(" + ", ".join(f"a{i}={0.1 * i}" for i in range(10))
        + ", sub=SimpleNamespace(" + ", ".join(f"b{i}={i}" for i in range(5)) + "))",
        "CONFIG = {'s': {" + ", ".join(f"'k{i}': {i}" for i in range(5)) + "}, 'obj': object()}",
        "def step(u):",
        "    s = " + " + ".join([*(f"cfg.a{i}" for i in range(10)),
                               *(f"cfg.sub.b{i}" for i in range(5)),
                               *(f"CONFIG['s']['k{i}']" for i in range(5))]),
        "    return u * s",
    ]
)  # fmt: skip


def bench_attribute_paths(reps: int, inner: int) -> dict[str, float]:
    """Median microseconds: the Python guard of a step reading 20 attribute paths (issue
    "Python state a step reads through attributes": under 5 us on this machine)."""
    namespace: dict[str, Any] = {"__name__": "bench_paths"}
    exec(compile(_PATHS, __file__, "exec"), namespace)  # user code (this file)
    reading = ptj.jit(namespace["step"])
    x = torch.randn(16)
    reading(x)
    guard = reading.specializations[0].python_guard
    assert guard is not None
    variants: dict[str, tuple[Callable[[], Any], int]] = {
        "reading": (lambda: reading(x), inner),
        "guard": (guard.holds, inner * 10),
    }
    result = medians(variants, reps)
    result["n"] = float(len(guard))
    return result


def bench_value_guard(reps: int, inner: int) -> dict[str, float]:
    """Median microseconds per call: a guarded Python branch vs the same as torch.where."""
    x = torch.randn(64)

    def branchy(u: torch.Tensor) -> torch.Tensor:
        return u * 2 if u.sum() > -1e9 else u

    def plain(u: torch.Tensor) -> torch.Tensor:  # the same branch as tensor operations
        return torch.where(u.sum() > -1e9, u * 2, u)

    guarded, unguarded = ptj.jit(branchy), ptj.jit(plain)
    guarded(x), unguarded(x)
    variants = {"guarded": lambda: guarded(x), "unguarded": lambda: unguarded(x)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            times[name].append(per_call(fn, inner))
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


if __name__ == "__main__":
    main()
