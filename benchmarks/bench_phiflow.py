"""PhiFlow steps: eager vs PhiML's own jit vs ``install()`` vs ``phi_torch_jit.jit``, one process.

Three simulations in the style of PhiFlow's historic demos, written here as plain step
functions:

* ``karman``: 128x128 staggered grid, inflow boundary mask, a cylinder obstacle, 'auto' solve;
* ``pipe``: 50x32 viscous pipe flow, explicit diffusion, 'CG-adaptive' solve;
* ``smoke``: this project's 64x64 smoke plume demo step (CG solve);
* ``bar``: 100x100, a rotating bar obstacle passed as an argument (new angle every step),
  MacCormack advection, 'CG-adaptive' solve;
* ``heat``, ``burgers``, ``gray_scott`` (128x128) and ``smoke3d`` (32^3): the programs of
  ``tests/phiflow_programs.py`` (implicit diffusion, viscous Burgers, Gray-Scott
  reaction-diffusion, a 3D smoke plume).

Each variant of a step gets its own function object: ``PhiML jit`` is
``math.jit_compile(step)`` with PhiML's own torch tracer (so it runs at its real speed),
``install()`` is ``math.jit_compile(step)`` compiled while :func:`phi_torch_jit.phiflow.install`
is in effect, ``ptj.jit`` is :func:`phi_torch_jit.jit`. Reported per simulation and variant:
the first call (record/trace/compile), the median of a fresh function's first 12 steps (first
call included: what a short run sees, the meter's eager samples and record passes too), the
median steady step with the compiled variants'
calls interleaved in every repetition, in an order that rotates (machine noise hits all
alike, and no variant always follows another), eager's steps timed after them in a loop of
their own (its long Python steps in between would leave the caches cold for the next
variant), and the largest
difference to eager after a few steps from a *new* state (not the one compiled on) and from
a fluid at rest (relative to the largest value; 0 where the state stays exactly zero).
Each variant's first steps start after the background compiles of the variants before it
have finished (``ptj.wait_compiled()``): while one runs, another function's calls cannot be
captured and run eagerly (docs/engines.md, "Several jitted functions").
Ratios are to PhiML's own jit. ``--engines torchscript compile`` adds ``ptj.jit`` with those
engines named (the default's step against every engine's, docs/phiflow.md). Writes JSON to
``benchmarks/results/`` and prints a markdown table. Not a test.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "demos"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from phi.torch.flow import (
    INF,
    ZERO_GRADIENT,
    Box,
    Obstacle,
    Solve,
    StaggeredGrid,
    advect,
    diffuse,
    extrapolation,
    fluid,
    geom,
    math,
    vec,
)
from phiflow_programs import PROGRAMS

import phi_torch_jit as ptj
import phi_torch_jit.phiflow as ptj_phiflow
from phi_torch_jit import _meter

Step = Callable[..., Any]

RESTART = 8
"""Steps after which every variant starts again from the initial state."""
FIRST = 12
"""Steps of a fresh function timed as a user's short run sees them (first call included):
their median is reported beside the steady step."""
WARM = _meter.WARM_UP + _meter.ROUND + 2 - FIRST
"""Untimed steps per variant before the timed ones (after the ``FIRST`` steps): phi_torch_jit's
meter times its first 26 calls of a specialization, one in 5 of them eager (51 where a first
round finds the program slower: NOTE [never slower than eager])."""


def karman() -> tuple[Step, tuple[Any, ...]]:
    speed = 2.0
    v = StaggeredGrid((speed, 0), ZERO_GRADIENT, x=128, y=128, bounds=Box(x=128, y=64))
    cylinder = Obstacle(geom.infinite_cylinder(x=15, y=32, radius=5, inf_dim=None))
    inflow = StaggeredGrid(Box(x=(-INF, 0.5), y=None), v.extrapolation, v.bounds, v.resolution)

    def karman_step(v: Any, p: Any) -> Any:
        v = advect.semi_lagrangian(v, v, 1.0)
        v = v * (1 - inflow) + inflow * (speed, 0)
        return fluid.make_incompressible(v, [cylinder], Solve("auto", 1e-5, x0=p))

    return karman_step, karman_step(v, None)


def pipe() -> tuple[Step, tuple[Any, ...]]:
    boundary = extrapolation.combine_sides(x=(vec(x=1, y=0), ZERO_GRADIENT), y=0)
    v = StaggeredGrid(0, boundary, x=50, y=32)

    def pipe_step(v: Any, p: Any) -> Any:
        v = advect.semi_lagrangian(v, v, 1.0)
        v = diffuse.explicit(v, 0.1, 1.0)
        return fluid.make_incompressible(v, solve=Solve("CG-adaptive", 1e-5, x0=p))

    return pipe_step, pipe_step(v, None)


def smoke() -> tuple[Step, tuple[Any, ...]]:
    from smoke_plume import initial_state, make_step

    v, s, inflow = initial_state(64)
    step = make_step(inflow)
    return step, step(v, s)  # a state with the steady structure (the first one is lazy)


def rotating_bar() -> tuple[Step, tuple[Any, ...]]:
    domain = dict(x=100, y=100, bounds=Box(x=100, y=100))
    obstacle = Obstacle(Box(x=(47, 53), y=(20, 70)), angular_velocity=0.05)
    v = StaggeredGrid(0, ZERO_GRADIENT, **domain)

    def bar_step(v: Any, obstacle: Any) -> Any:
        obstacle = math.copy_with(obstacle, geometry=obstacle.geometry.rotated(-0.05))
        v = advect.mac_cormack(v, v, 1.0)
        v, _ = fluid.make_incompressible(v, (obstacle,), Solve("CG-adaptive", 1e-5, 1e-5))
        return v, obstacle

    return bar_step, bar_step(*bar_step(v, obstacle))


def _program(name: str, n: int) -> Callable[[], tuple[Step, tuple[Any, ...]]]:
    """A program of tests/phiflow_programs.py at resolution ``n``, its state made steady."""

    def make() -> tuple[Step, tuple[Any, ...]]:
        step, state = PROGRAMS[name](n)
        return step, step(*state)

    return make


SIMULATIONS = {
    "karman": karman,
    "pipe": pipe,
    "smoke": smoke,
    "bar": rotating_bar,
    "heat": _program("heat", 128),
    "burgers": _program("burgers", 128),
    "gray_scott": _program("reaction_diffusion", 128),
    "smoke3d": _program("smoke3d", 32),
}


def _perturbed(state: tuple[Any, ...]) -> tuple[Any, ...]:
    """A new state: noise of a tenth of the velocity's largest value (at least 0.01), drawn
    from a fixed seed (a 3D smoke at rest perturbed by 0.1 made its CG stall for some draws)."""
    v = state[0]
    scale = 0.1 * max(float(math.max(abs(v.values))), 0.1)
    math.seed(0)
    noisy = v.with_values(v.values + scale * math.random_normal(v.values.shape))
    return (noisy, *state[1:])


def _at_rest(state: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(x * 0 if hasattr(x, "values") else x for x in state)


def _rollout(step: Step, state: tuple[Any, ...], n: int) -> tuple[Any, ...]:
    for _ in range(n):
        state = step(*state)
    return state


def _fields(state: tuple[Any, ...]) -> list[Any]:
    return [x for x in state if hasattr(x, "values")]


def _max_diff(a: tuple[Any, ...], b: tuple[Any, ...]) -> float:
    scale = max(float(math.max(abs(x.values))) for x in _fields(a)) or 1.0
    diffs = [float(math.max(abs(x.values - y.values))) for x, y in zip(_fields(a), _fields(b))]
    return max(diffs) / scale


class _WhileInstalled:
    """``fn`` called with :func:`phi_torch_jit.phiflow.install` in effect (as in a script that
    installed it at its start), and PhiML's own jit restored after the call, so the variants
    can interleave. Timed calls leave the two out (:func:`_timed`): a script pays neither."""

    def __init__(self, fn: Step) -> None:
        self.fn = fn

    def __call__(self, *state: Any) -> Any:
        ptj_phiflow.install()
        try:
            return self.fn(*state)
        finally:
            ptj_phiflow.uninstall()


def _timed(fn: Step, state: tuple[Any, ...]) -> tuple[Any, float]:
    """``fn(*state)`` and the seconds it took."""
    installed = isinstance(fn, _WhileInstalled)
    if installed:
        ptj_phiflow.install()
    try:
        call = fn.fn if isinstance(fn, _WhileInstalled) else fn
        start = time.perf_counter()
        result = call(*state)
        return result, time.perf_counter() - start
    finally:
        if installed:
            ptj_phiflow.uninstall()


def _variants(
    make: Callable[[], tuple[Step, tuple[Any, ...]]], engines: tuple[str, ...] = ()
) -> dict[str, Step]:
    step, _ = make()
    phiml = math.jit_compile(make()[0])
    installed = _WhileInstalled(math.jit_compile(make()[0]))
    variants = {"eager": step, "PhiML jit": phiml, "install()": installed, "ptj.jit": ptj.jit(step)}
    for engine in engines:  # the default's step against each named engine's (issue 34)
        variants[f"ptj.jit, engine {engine!r}"] = ptj.jit(make()[0], engine=engine)
    return variants


def bench(name: str, reps: int, engines: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    make = SIMULATIONS[name]
    _, state = make()
    variants = _variants(make, engines)
    rows: dict[str, dict[str, Any]] = {k: {"simulation": name, "variant": k} for k in variants}
    for label, fn in variants.items():  # a fresh function's first FIRST steps, as a user's
        current, seconds = state, []  # short run sees them (record passes, meter included)
        for n in range(FIRST):
            if n % RESTART == RESTART - 1:
                current = state
            current, took = _timed(fn, current)
            seconds.append(took)
        rows[label]["first_call_s"] = seconds[0] + seconds[1]  # and the steady structure's
        rows[label]["first_steps_ms"] = 1e3 * statistics.median(seconds)
        # A compile still running (engine auto's, on its thread) holds the tracing lock: the
        # next variant's first steps could not be captured and would run eagerly.
        ptj.wait_compiled()
    times: dict[str, list[float]] = {k: [] for k in variants}
    compiled = [k for k in variants if k != "eager"]
    # The compiled variants interleave, in an order that rotates; eager runs in a loop of its
    # own after them. Interleaved, its 10-20x longer Python steps left the caches cold for
    # whichever variant came next, and with four variants rotating, install() followed eager
    # in one repetition of four and ptj.jit never did (install() / ptj.jit: 1.11-1.12 against
    # 1.02-1.04 without eager in between).
    for group, warm in ((compiled, WARM), (["eager"], 2)):
        current = {k: state for k in group}
        for n in range(warm + reps):  # WARM: past the meter's timed calls of ptj.jit
            if n % RESTART == RESTART - 1:  # a long rollout diverges (3D smoke at its 11th
                # step): start again, with the first step (another structure) untimed
                current = {k: variants[k](*state) for k in group}
            for label in group[n % len(group) :] + group[: n % len(group)]:  # no variant
                current[label], seconds = _timed(variants[label], current[label])  # first
                if n >= warm:
                    times[label].append(seconds)
    for label in variants:
        rows[label]["step_ms"] = 1e3 * statistics.median(times[label])
    reference = rows["PhiML jit"]["step_ms"]
    first_reference = rows["PhiML jit"]["first_steps_ms"]
    for label in variants:
        rows[label]["vs_phiml"] = rows[label]["step_ms"] / reference
        rows[label]["first_vs_phiml"] = rows[label]["first_steps_ms"] / first_reference
    new_state = _perturbed(state)
    rest = _at_rest(state)
    eager_new = _rollout(variants["eager"], new_state, 3)
    eager_rest = _rollout(variants["eager"], rest, 3)
    for label, fn in variants.items():
        rows[label]["rel_diff_new_state"] = _max_diff(eager_new, _rollout(fn, new_state, 3))
        rows[label]["rel_diff_at_rest"] = _max_diff(eager_rest, _rollout(fn, rest, 3))
    return list(rows.values())


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| simulation | variant | first call | median of first 12 steps (vs PhiML jit) "
        "| steady step | vs PhiML jit | rel. diff, new state | rel. diff, from rest |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['simulation']} | {r['variant']} | {r['first_call_s']:.2f} s "
            f"| {r['first_steps_ms']:.2f} ms ({r['first_vs_phiml']:.2f}x) "
            f"| {r['step_ms']:.2f} ms | {r['vs_phiml']:.2f}x | {r['rel_diff_new_state']:.1e} "
            f"| {r['rel_diff_at_rest']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sims", nargs="+", default=list(SIMULATIONS), choices=SIMULATIONS)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument(
        "--engines",
        nargs="*",
        default=[],
        help="also time ptj.jit with these engines named (torchscript, compile, ...)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # PhiML's sparse-CSR beta notice, deprecations
    meta = {"torch": torch.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "reps": args.reps}  # fmt: skip
    print(json.dumps(meta), flush=True)
    rows: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    for name in args.sims:  # each simulation's rows as it finishes: a long run keeps them
        try:
            rows.extend(bench(name, args.reps, tuple(args.engines)))
        except Exception as error:  # one simulation failing must not lose the others
            failed[name] = f"{type(error).__name__}: {error}".splitlines()[0]
            print(f"{name}: failed: {failed[name]}", flush=True)
            traceback.print_exc()
            continue
        print(_table([r for r in rows if r["simulation"] == name]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "rows": rows, "failed": failed}
    (args.out / "phiflow.json").write_text(json.dumps(result, indent=2))
    print(_table(rows))


if __name__ == "__main__":
    main()
