"""PhiFlow's backward: a gradient step through two simulated smoke steps, one process.

The loss of an initial velocity (``tests/phiflow_programs.smoke_match``: smoke advected for two
steps, each made incompressible by a CG pressure solve, against a target), jitted three ways:
eager, PhiML's own ``math.jit_compile`` (its torch tracer: TorchScript, the CG a scripted loop)
and :func:`phi_torch_jit.jit` (the default engine). What a user calls is
``field.functional_gradient`` of it: a gradient step runs the loss and its backward, where
PhiML's adjoint pressure solves run.

Two boxes: ``open`` (velocity ZERO_GRADIENT: the pressure system is definite, CG converges the
same way on every engine) and ``closed`` (PhiML adds a row and a column of ones for the free
mean: an indefinite system on which float32 CG diverges on about one input in five, eagerly as
compiled, decided by rounding). Reported per box and variant: the first call, the median of a
fresh function's first 12 gradient steps (what a short optimization sees), the steady median
(the compiled variants interleaved per repetition; eager timed after them), the largest relative
difference of the gradient to eager's (on a step after the compile: the meter's eager samples
among the first steps are eager's own), how many gradient steps raised ``Diverged`` (counted,
timed, not stopping the run), and for ``ptj.jit`` what ``explain()`` says serves. The gradient
steps cycle through :data:`INPUTS` velocities near one another, the same for every variant (a
descent would change the solves' iteration counts between variants). Ratios are to PhiML's jit.
Not a test.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from phi.torch.flow import ZERO_GRADIENT, Box, StaggeredGrid, field, math
from phiflow_programs import smoke_match
from phiml.math import ConvergenceException

import phi_torch_jit as ptj

FIRST = 12
"""Gradient steps of a fresh function whose median is reported beside the steady step."""
INPUTS = 16
"""Velocities the gradient steps cycle through (the start scaled by 1 + 1e-4 i), the same
sequence for every variant: on the closed box, rounding decides per input whether a solve
diverges, as along an optimization."""


def _start(box: str, n: int) -> tuple[Callable[..., Any], Any]:
    """The loss and the velocity the gradient steps start near: one eager descent step from
    rest (at rest the solves have nothing to do)."""
    loss, rest = smoke_match(n)
    if box == "open":
        rest = StaggeredGrid(0, ZERO_GRADIENT, x=n, y=n, bounds=Box(x=n, y=n))
    _, gradient = field.functional_gradient(loss, "v0", get_output=True)(rest)
    return loss, rest - gradient


def _gradient_step(fn: Callable[..., Any]) -> Callable[[Any], Any]:
    gradient = field.functional_gradient(fn, "v0", get_output=True)

    def step(v: Any) -> Any:
        loss, grad = gradient(v)
        float(loss)  # wait for the values
        return grad

    return step


RAISED: dict[int, int] = {}
"""Gradient steps whose solve diverged (PhiML's ConvergenceException), by step function."""


def _timed(step: Callable[[Any], Any], v: Any) -> tuple[Any, float]:
    """The gradient and its time; None where a solve diverged (counted in :data:`RAISED`:
    float32 CG on the closed box diverges on some inputs, eagerly too)."""
    start = time.perf_counter()
    try:
        grad = step(v)
    except ConvergenceException:
        RAISED[id(step)] = RAISED.get(id(step), 0) + 1
        grad = None
    return grad, time.perf_counter() - start


def _relative(a: Any, b: Any) -> float:
    largest = float(math.max(abs(b.values)))
    return float(math.max(abs(a.values - b.values))) / max(largest, 1e-30)


def bench(box: str, n: int, reps: int, verbose: bool = False) -> list[dict[str, Any]]:
    loss, v = _start(box, n)
    jitted = ptj.jit(loss)
    variants: dict[str, Callable[..., Any]] = {
        "PhiML jit": math.jit_compile(loss),
        "ptj.jit": jitted,
    }
    steps = {name: _gradient_step(fn) for name, fn in variants.items()}
    eager_step = _gradient_step(loss)
    inputs = [v * (1 + 1e-4 * i) for i in range(INPUTS)]
    want = _timed(eager_step, inputs[FIRST - 1])[0]
    rows: dict[str, dict[str, Any]] = {}
    for name, step in steps.items():
        first: list[float] = []
        for i in range(FIRST):
            grad, seconds = _timed(step, inputs[i])
            first.append(seconds)
        if verbose:
            print(name, " ".join(f"{1e3 * t:.0f}" for t in first))
        rows[name] = {
            "first call s": first[0],
            "first 12 ms": 1e3 * statistics.median(first),
            "steady": [],
        }
    jitted.wait_compiled()
    for name, step in steps.items():  # warm after the switch (the meter decides meanwhile)
        for i in range(6):
            _timed(step, inputs[i])
        # compared once the compiled program serves (the 12th step may be an eager sample)
        grad = _timed(step, inputs[FIRST - 1])[0]
        ok = grad is not None and want is not None
        rows[name]["difference"] = _relative(grad, want) if ok else None
    for rep in range(reps):
        names = list(steps)
        names = names[rep % len(names) :] + names[: rep % len(names)]
        for name in names:
            rows[name]["steady"].append(_timed(steps[name], inputs[rep % INPUTS])[1])
    eager_s = [_timed(eager_step, inputs[i % INPUTS])[1] for i in range(max(3, reps // 3))]
    for name, step in steps.items():
        rows[name]["diverged"] = RAISED.get(id(step), 0)
    phiml = statistics.median(rows["PhiML jit"]["steady"])
    table = [
        {
            "box": box,
            "variant": "eager",
            "steady ms": 1e3 * statistics.median(eager_s),
            "vs PhiML jit": statistics.median(eager_s) / phiml,
            "diverged": RAISED.get(id(eager_step), 0),
        }
    ]
    for name, row in rows.items():
        steady = statistics.median(row.pop("steady"))
        table.append({"box": box, "variant": name, "steady ms": 1e3 * steady,
                      "vs PhiML jit": steady / phiml, **row})  # fmt: skip
    serving = [line.strip() for line in jitted.explain().splitlines() if "step time" in line]
    table[-1]["serves"] = serving[0] if serving else ""
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--boxes", nargs="+", default=["open", "closed"], choices=["open", "closed"]
    )
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("-v", action="store_true", help="print the first steps' times")
    args = parser.parse_args()
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.n}x{args.n}")
    print("| box | variant | first call | median of first 12 | steady step | vs PhiML jit | "
          "gradient vs eager | steps diverged |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    notes = []
    for box in args.boxes:
        for row in bench(box, args.n, args.reps, args.v):
            first = f"{row['first call s']:.2f} s" if "first call s" in row else ""
            first12 = f"{row['first 12 ms']:.1f} ms" if "first 12 ms" in row else ""
            diff = f"{row['difference']:.1e}" if row.get("difference") is not None else ""
            print(f"| {box} | {row['variant']} | {first} | {first12} | {row['steady ms']:.1f} ms "
                  f"| {row['vs PhiML jit']:.2f}x | {diff} | {row['diverged']} |")  # fmt: skip
            if row.get("serves"):
                notes.append(f"{box}: ptj.jit {row['serves']}")
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
