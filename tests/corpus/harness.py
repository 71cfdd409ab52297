"""Run one corpus program eagerly and through ``phi_torch_jit.jit``, and compare the two.

A *program* is third-party code written the way its library's documentation writes it: a model,
a loss (or a simulation), and a loop of ``optimizer.zero_grad(); loss = fn(*batch);
loss.backward(); optimizer.step()``. Only ``fn`` (the per-iteration forward + loss the docs
write) is jitted; the loop around it is the same for both runs.

Both runs start from the same seeds (torch, NumPy, Python ``random``) and reseed torch before
every step, so dropout masks and sampled noise are the same draws in both. What is compared,
step by step: every tensor ``fn`` returns, every parameter gradient; at the end: every
parameter and buffer, and the optimizer state.

Shared by ``tests/corpus/test_corpus.py`` and ``benchmarks/corpus_table.py``.
"""

from __future__ import annotations

import functools
import logging
import random
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import phi_torch_jit as ptj
from phi_torch_jit.engines import available_engines, register_engine
from phi_torch_jit.engines.auto import AutoEngine

ENGINES = ("torchscript", "compile", "auto-on-caller")
"""Engines the corpus runs: ``compile`` and ``auto`` with backend ``aot_eager`` (the whole
graph capture without inductor's code generation, to keep CI time down); ``auto`` compiling on
the caller's thread so trace counts are deterministic."""

STEPS = 3
"""Training/simulation steps compared per program (K)."""

SEED = 0

BATCHES = 4
"""Builders make batches 0..3; step k uses batch k % 4 (timed steps cycle through them)."""

WARM_UP = 2 * BATCHES
"""Untimed steps before the timed ones: every batch's signature seen twice, so engine auto
has compiled each (on the caller's thread) and the timed steps measure steady state."""

AUTO_ON_CALLER = "auto-on-caller"


def ensure_auto_on_caller() -> None:
    """Register engine ``auto-on-caller`` (tests/conftest.py does too) where it is missing."""
    if AUTO_ON_CALLER not in available_engines():
        register_engine(AUTO_ON_CALLER, functools.partial(AutoEngine, compile_on="caller"))


def jit_for(engine: str, fn: Callable[..., Any]) -> ptj.JitFunction:
    """``ptj.jit(fn)`` for one corpus engine."""
    if engine == "torchscript":
        return ptj.jit(fn, engine="torchscript")
    ensure_auto_on_caller()
    return ptj.jit(fn, engine=engine, backend="aot_eager")


@dataclass
class Built:
    """One freshly built instance of a program (models, optimizer, data)."""

    fn: Callable[..., Any]
    """What the docs compute per iteration: returns the loss, or ``(loss, *outputs)``, or
    (``optimizer`` None and ``backward`` False) just outputs."""
    batches: Callable[[int], tuple[Any, ...]]
    """The arguments of ``fn`` for step k (deterministic in k)."""
    modules: Sequence[torch.nn.Module]
    """Whose parameters, gradients and buffers are compared."""
    optimizer: torch.optim.Optimizer | None = None
    backward: bool = True
    """Call ``loss.backward()`` each step."""
    after_backward: Callable[[], None] | None = None
    """What the docs do between backward and ``optimizer.step()`` (gradient clipping)."""
    extra_state: Callable[[], dict[str, torch.Tensor]] | None = None
    """Other tensors to compare at the end (e.g. leaf tensors trained outside modules)."""


@dataclass(frozen=True)
class Program:
    """A corpus entry: how to build it and what it needs."""

    name: str
    library: str
    """The pip distribution that provides the code under test (``torch`` for torch.nn)."""
    module: str
    """The import name to ``pytest.importorskip``."""
    build: Callable[[], Built]
    description: str
    rtol: float = 1e-4
    atol: float = 1e-5


@dataclass
class Trajectory:
    """Everything recorded from K steps of one run."""

    outputs: list[list[torch.Tensor]] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor | None]] = field(default_factory=list)
    final: dict[str, torch.Tensor] = field(default_factory=dict)
    step_times: list[float] = field(default_factory=list)


@dataclass
class Outcome:
    """A jitted run compared with eager."""

    program: str
    engine: str
    result: str
    """``equal`` (compiled) | ``eager-warned`` (equal, ran eagerly, one JitWarning names why) |
    ``eager-logged`` (equal, ran eagerly, no JitWarning but phi_torch_jit's WARNING log line
    names why) | ``error`` | ``differs`` | ``warned`` (equal, but JitWarnings other than one
    eager fallback)."""
    detail: str = ""
    traces: int | None = None
    jit_warnings: list[str] = field(default_factory=list)
    eager_reasons: list[str] = field(default_factory=list)
    tracer_warnings: list[str] = field(default_factory=list)
    other_warnings: list[str] = field(default_factory=list)
    log_warnings: list[str] = field(default_factory=list)
    """WARNING records of the ``phi_torch_jit`` logger."""
    jit_time: float | None = None
    eager_time: float | None = None

    @property
    def accepted(self) -> bool:
        return self.result in ("equal", "eager-warned", "eager-logged")


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def _flat_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value.detach().clone()]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _flat_tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat_tensors(v)]
    if hasattr(value, "to_tuple"):  # transformers ModelOutput
        return _flat_tensors(value.to_tuple())
    return []


def _loss_of(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "loss") and value.loss is not None:
        return value.loss
    if isinstance(value, (list, tuple)):
        return value[0]
    raise TypeError(f"cannot find the loss in {type(value).__name__}")


def _named_parameters(built: Built) -> list[tuple[str, torch.nn.Parameter]]:
    return [(f"m{i}.{n}", p) for i, m in enumerate(built.modules) for n, p in m.named_parameters()]


def _final_state(built: Built) -> dict[str, torch.Tensor]:
    state = {
        f"m{i}.{k}": v.detach().clone()
        for i, m in enumerate(built.modules)
        for k, v in m.state_dict().items()
        if isinstance(v, torch.Tensor)
    }
    if built.optimizer is not None:
        for pid, entry in built.optimizer.state_dict()["state"].items():
            for k, v in entry.items():
                if isinstance(v, torch.Tensor):
                    state[f"opt.{pid}.{k}"] = v.detach().clone()
    if built.extra_state is not None:
        state.update({f"x.{k}": v.detach().clone() for k, v in built.extra_state().items()})
    return state


def run_steps(
    built: Built,
    fn: Callable[..., Any],
    steps: int,
    first_step: int = 0,
    record: bool = True,
) -> Trajectory:
    """Steps ``first_step .. first_step + steps - 1`` of the documented loop, with ``fn``."""
    trajectory = Trajectory()
    params = _named_parameters(built)
    for k in range(first_step, first_step + steps):
        args = built.batches(k % BATCHES)
        torch.manual_seed(SEED + 1000 + k)
        start = time.perf_counter()
        if built.optimizer is not None:
            built.optimizer.zero_grad()
        out = fn(*args)
        if built.backward:
            _loss_of(out).backward()
            if built.after_backward is not None:
                built.after_backward()
        if built.optimizer is not None:
            built.optimizer.step()
        trajectory.step_times.append(time.perf_counter() - start)
        if record:
            trajectory.outputs.append(_flat_tensors(out))
            trajectory.grads.append(
                {n: None if p.grad is None else p.grad.detach().clone() for n, p in params}
            )
    if record:
        trajectory.final = _final_state(built)
    return trajectory


def build(program: Program) -> Built:
    seed_all(SEED)
    return program.build()


def compare(eager: Trajectory, jitted: Trajectory, program: Program) -> str:
    """An empty string if equal within the program's tolerances, else the first difference."""
    close = functools.partial(torch.testing.assert_close, rtol=program.rtol, atol=program.atol)
    try:
        for k, (a, b) in enumerate(zip(eager.outputs, jitted.outputs)):
            if len(a) != len(b):
                return f"step {k}: {len(b)} output tensors, eager {len(a)}"
            for i, (x, y) in enumerate(zip(a, b)):
                close(y, x, msg=lambda m, k=k, i=i: f"step {k} output {i}: {m}")
        for k, (a, b) in enumerate(zip(eager.grads, jitted.grads)):
            for name, x in a.items():
                y = b[name]
                if (x is None) != (y is None):
                    return f"step {k} grad {name}: None in one run only (jit {y is None})"
                if x is not None:
                    close(y, x, msg=lambda m, k=k, n=name: f"step {k} grad {n}: {m}")
        for name, x in eager.final.items():
            if name not in jitted.final:
                return f"final {name} missing"
            close(jitted.final[name], x, msg=lambda m, n=name: f"final {n}: {m}")
    except AssertionError as error:
        return " ".join(str(error).split())[:600]
    return ""


class _WarningLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _warning_text(w: warnings.WarningMessage) -> str:
    return f"{w.category.__name__}: {w.message}"


def run_program(program: Program, engine: str, steps: int = STEPS, timed_steps: int = 0) -> Outcome:
    """Eager vs jitted on ``engine``; ``timed_steps`` > 0 also times further steps of both."""
    with warnings.catch_warnings(record=True) as eager_caught:
        warnings.simplefilter("always")
        eager_built = build(program)
        eager = run_steps(eager_built, eager_built.fn, steps)
        if timed_steps:
            run_steps(eager_built, eager_built.fn, WARM_UP, steps, record=False)
            eager.step_times = run_steps(
                eager_built, eager_built.fn, timed_steps, steps + WARM_UP, record=False
            ).step_times
    eager_texts = {_warning_text(w) for w in eager_caught}
    outcome = Outcome(program.name, engine, "error")
    jitted_fn: ptj.JitFunction | None = None
    log = _WarningLog()
    logger = logging.getLogger("phi_torch_jit")
    logger.addHandler(log)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            built = build(program)
            jitted_fn = jit_for(engine, built.fn)
            jitted = run_steps(built, jitted_fn, steps)
            if timed_steps:
                run_steps(built, jitted_fn, WARM_UP, steps, record=False)
                jitted.step_times = run_steps(
                    built, jitted_fn, timed_steps, steps + WARM_UP, record=False
                ).step_times
        except Exception as error:
            outcome.detail = f"{type(error).__name__}: {' '.join(str(error).split())}"[:600]
            jitted = None
        finally:
            logger.removeHandler(log)
    outcome.log_warnings = log.messages
    for w in caught:
        text = _warning_text(w)
        if issubclass(w.category, ptj.JitWarning):
            outcome.jit_warnings.append(str(w.message))
        elif issubclass(w.category, torch.jit.TracerWarning):
            outcome.tracer_warnings.append(text)
        elif text not in eager_texts:
            outcome.other_warnings.append(text)
    if jitted_fn is not None:
        outcome.traces = jitted_fn.num_traces
        outcome.eager_reasons = [
            s.eager_reason for s in jitted_fn.specializations if s.eager_reason
        ]
    if jitted is None:
        return outcome
    if timed_steps:
        outcome.eager_time = statistics.median(eager.step_times)
        outcome.jit_time = statistics.median(jitted.step_times)
    difference = compare(eager, jitted, program)
    if difference:
        outcome.result, outcome.detail = "differs", difference
    elif not outcome.jit_warnings and not outcome.eager_reasons:
        outcome.result = "equal"
    elif not outcome.jit_warnings and len(set(outcome.eager_reasons)) == 1:
        outcome.result = "eager-logged"
        outcome.detail = outcome.eager_reasons[0]
    elif len(outcome.jit_warnings) == 1 and "runs eagerly" in outcome.jit_warnings[0]:
        outcome.result = "eager-warned"
        outcome.detail = outcome.jit_warnings[0]
    else:
        outcome.result = "warned"
        outcome.detail = " | ".join(outcome.jit_warnings)[:600]
    return outcome
