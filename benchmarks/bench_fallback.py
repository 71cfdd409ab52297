"""Never slower than eager: step time of jitted programs that compilers serve badly, per engine.

Workloads (each a step users write, data changing from call to call):

* ``adaptive``: an adaptive-step ODE solve (``while t < t1``, step size from ``float(err)``);
* ``random_depth``: a per-call random choice (``n = int(torch.randint(...))`` iterations);
* ``until_converged``: a loss minimized until ``bool(err < tol)`` inside the step;
* ``complex_scatter``: complex arithmetic with in-place strided writes (TorchScript was slower
  than eager on such code);
* ``cnn``: a small convolutional step (fast when compiled: must stay fast).

Per workload and engine, the jitted function is called ``--warm`` times on fresh data (what a
user's loop does; its self-measurement decides meanwhile), then jitted and eager calls are
interleaved and timed; reported: median step time ratio jitted / eager, traces, and whether it
ended up serving eager code. Target: at most 1.1x on every engine after warm-up. Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import phi_torch_jit as ptj

torch.manual_seed(0)
_FIELD = nn.Linear(16, 16)
_CNN = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.Tanh(), nn.Conv2d(8, 1, 3, padding=1))


def adaptive(y: torch.Tensor) -> torch.Tensor:
    t, h = 0.0, 0.05
    while t < 1.0:
        k1 = torch.tanh(_FIELD(y))
        k2 = torch.tanh(_FIELD(y + h * k1))
        err = float((k2 - k1).abs().max())
        y = y + 0.5 * h * (k1 + k2)
        t += h
        h = min(0.2, max(0.01, 0.02 / (err + 1e-4)))
    return y


def random_depth(x: torch.Tensor) -> torch.Tensor:
    n = int(torch.randint(1, 20, ()))
    for _ in range(n):
        x = torch.tanh(_FIELD(x))
    return x


def until_converged(x: torch.Tensor) -> torch.Tensor:
    target = torch.ones_like(x)
    for _ in range(200):
        residual = x - target
        if bool(residual.abs().max() < 1e-3):
            break
        x = x - 0.1 * residual
    return x


def complex_scatter(z: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(z)
    for k in range(8):
        out[..., k::8] = z[..., k::8] * torch.exp(1j * k * z.real[..., k::8])
    return out


def cnn(x: torch.Tensor) -> torch.Tensor:
    return x + 0.1 * _CNN(x)


WORKLOADS: dict[str, tuple[Callable[..., Any], Callable[[], torch.Tensor]]] = {
    "adaptive": (adaptive, lambda: torch.randn(32, 16)),
    "random_depth": (random_depth, lambda: torch.randn(32, 16)),
    "until_converged": (until_converged, lambda: torch.randn(64, 64)),
    "complex_scatter": (complex_scatter, lambda: torch.randn(64, 512, dtype=torch.complex64)),
    "cnn": (cnn, lambda: torch.randn(4, 1, 64, 64)),
}


def measure(fn: Callable[..., Any], data: Callable[[], torch.Tensor], engine: str,
            warm: int, reps: int) -> dict[str, Any]:  # fmt: skip
    jitted = ptj.jit(fn, engine=engine)
    with warnings.catch_warnings(), torch.no_grad():  # warm-up and timing in one grad mode
        warnings.simplefilter("ignore")
        for _ in range(warm):
            jitted(data())
        if engine == "auto":
            jitted.wait_compiled()
            for _ in range(warm):
                jitted(data())
        times: dict[str, list[float]] = {"jit": [], "eager": []}
        for rep in range(reps):
            x = data()
            pair = (("jit", jitted), ("eager", fn))
            for name, f in pair if rep % 2 else pair[::-1]:  # neither always runs first
                torch.manual_seed(rep)  # the same random choices (random_depth) for both
                start = time.perf_counter()
                f(x)
                times[name].append(time.perf_counter() - start)
    report = jitted.explain()
    return {
        "ratio": statistics.median(times["jit"]) / statistics.median(times["eager"]),
        "eager_ms": statistics.median(times["eager"]) * 1e3,
        "traces": jitted.num_traces,
        "serves": "eager" if "runs eagerly" in report or "serves eager" in report else "compiled",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", default=["torchscript", "compile", "auto"])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--warm", type=int, default=40)
    parser.add_argument("--reps", type=int, default=101)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, medians of {args.reps}")
    print(f"| workload | eager | {' | '.join(args.engines)} |")
    print(f"|---|---|{'---|' * len(args.engines)}")
    for name in args.workloads:
        fn, data = WORKLOADS[name]
        cells = []
        eager_ms = 0.0
        for engine in args.engines:
            result = measure(fn, data, engine, args.warm, args.reps)
            eager_ms = result["eager_ms"]
            cells.append(f"{result['ratio']:.2f}x ({result['traces']} traces, {result['serves']})")
        print(f"| {name} | {eager_ms:.2f} ms | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
