"""What a jitted function tells its user: the ``explain()`` report, logs and warnings.

:class:`Reporter` belongs to one jitted function and says each thing once where once is
enough: that a specialization runs eagerly, that Python side effects will not repeat, that
``max_traces`` was passed; it logs every trace with its reason.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Sequence

from ._ambient import describe_ambient
from ._custom_op import CompiledCall
from ._reads._records import Read
from ._spec_text import describe_spec, first_difference
from ._specialization import Key, Specialization
from ._warnings import describe_warning, reemit
from .engines import CompiledModule, Engine
from .errors import GuardError, JitWarning

__all__ = ["explain", "explain_specialization", "Reporter"]

logger = logging.getLogger("phi_torch_jit")


def explain(
    report: Reporter,
    engine: Engine,
    specializations: Iterable[Specialization],
    gave_up: bool = False,
    paths: Sequence[tuple[Key, str]] = (),
) -> str:
    """The ``explain()`` report of a jitted function."""
    lines = [
        f"{report.owner}: engine {engine.name!r}, {report.num_traces} trace(s), "
        f"max_traces={report.max_traces}"
    ]
    if engine.passthrough:
        lines.append("  runs eagerly: nothing is recorded or compiled")
    if gave_up:
        lines.append(f"  runs eagerly: {report.gave_up_reason}")
    for i, spec in enumerate(specializations):
        lines += explain_specialization(i, spec)
    for key, figures in paths:
        lines.append(f"  several paths of {describe_spec(key[0])}: {figures}")
    return "\n".join(lines)


def _grads_read(spec: Specialization) -> list[str]:
    """The line saying that the module guard checks ``requires_grad`` (:mod:`._unguardable`)."""
    if spec.guard is None or not spec.guard.grads_read:
        return []
    places = ", ".join(spec.guard.grads_read[:3])
    return [f"    parameters' requires_grad checked on every call: Python reads it at {places}"]


def _layouts_read(spec: Specialization) -> list[str]:
    """The line naming the parameters and buffers whose layout the module guard checks."""
    laid_out = () if spec.guard is None else spec.guard.laid_out
    if not laid_out:
        return []
    shown = ", ".join(f"{name} (read at {where})" for name, _, _, where in laid_out[:3])
    return [f"    layout (shape, dtype, strides) checked on every call: {shown}"]


def explain_specialization(index: int, spec: Specialization) -> list[str]:
    """The ``explain()`` lines of one specialization."""
    grad = "grad enabled" if spec.key[1] else "grad disabled"
    if spec.key[2] is not None:
        grad += ", " + describe_ambient(spec.key[2])
    t = spec.timings
    lines = [
        f"[{index}] {describe_spec(spec.key[0])}, {grad}",
        f"    modules: {', '.join(spec.modules) or 'none'}"
        + (f" ({len(spec.guard.modules)} guarded)" if spec.guard else ""),
        *_grads_read(spec),
        *_layouts_read(spec),
        f"    times: record {t.record * 1e3:.1f} ms, compile custom functions "
        f"{t.compile_custom * 1e3:.1f} ms, trace {t.trace * 1e3:.1f} ms",
    ]
    lines += [f"    engine: {note}" for note in spec.engine_notes]
    if spec.engine_status is not None:
        lines += [f"    engine: {note}" for note in spec.engine_status()]
    if spec.eager_reason:
        lines.append(f"    runs eagerly: {spec.eager_reason}")
    for reason in spec.failed:
        lines.append(f"    runs eagerly: {reason}")
    if spec.meter is not None:
        lines.append(f"    {spec.meter.describe()}")
    elif not spec.calls:
        lines.append("    custom functions: none")
    for call in spec.calls:
        lines += _explain_call(call)
    lines += [f"    value guard: {g.describe()}" for g in spec.value_guards]
    for read in spec.python_guard.reads if spec.python_guard is not None else ():
        how = "input of the program" if read.kind.value == "tensor" else f"by {read.kind.value}"
        if read.unguarded:
            how += f"; not guarded: {read.unguarded}"
        lines.append(f"    python read: {read.source.label} at {read.source.location}, {how}")
    lines += [f"    tracer warning: {w}" for w in spec.tracer_warnings]
    return lines


def _explain_call(call: CompiledCall) -> list[str]:
    forward = call.forward
    mode = forward.mode + (f" ({forward.reason})" if forward.reason else "")
    lines = [
        f"    custom function {call.function.label} as op {call.op_name}:",
        f"      forward: {mode}",
    ]
    backwards = call.backward.specializations
    if not backwards:
        lines.append("      backward: not compiled yet (compiled at the first backward)")
    for pattern, b in backwards.items():
        reason = f" ({b.compiled.reason})" if b.compiled is not None and b.compiled.reason else ""
        lines.append(f"      backward for needs_input_grad={pattern}: {b.mode}{reason}")
    return lines


class Reporter:
    """Logs and warnings of one jitted function (``owner`` names it in every message)."""

    def __init__(self, owner: str, arg_names: tuple[str, ...], max_traces: int) -> None:
        self.owner = owner
        self.arg_names = arg_names
        self.max_traces = max_traces
        self.num_traces = 0
        """How many specializations have been built."""
        self._last_key: Key | None = None
        self._warned_max = False
        self._eager_logged = False
        self._side_effects_warned = False
        self._cannot_compile_warned = False

    def traced(self, key: Key, reason: str | None) -> None:
        """Count and log a trace; warn once past ``max_traces``."""
        self.num_traces += 1
        if reason is None:
            reason = "first call" if self._last_key is None else self.change(self._last_key, key)
        self._last_key = key
        logger.info("phi_torch_jit: traced %s (#%d): %s", self.owner, self.num_traces, reason)
        if self.num_traces > self.max_traces and not self._warned_max:
            self._warned_max = True  # and the cache drops the least recently used one
            warnings.warn(
                JitWarning(
                    f"phi_torch_jit: {self.owner} has been traced {self.num_traces} times "
                    f"(max_traces={self.max_traces}); the last retrace was caused by {reason}. "
                    "The least recently used specializations are dropped from now on. Pass "
                    "values that change from call to call as tensors, or raise max_traces."
                ),
                stacklevel=4,
            )

    def change(self, old: Key, new: Key) -> str:
        """What differs between two cache keys, e.g. ``dt: 0.1 -> 0.2``."""
        if old[0] != new[0]:
            return first_difference(old[0], new[0], self.arg_names)
        if old[1] != new[1]:
            states = {True: "enabled", False: "disabled"}
            return f"grad mode {states[old[1]]} -> {states[new[1]]}"
        return f"{describe_ambient(old[2])} -> {describe_ambient(new[2])}"

    def evicted(self, dropped: Specialization) -> None:
        logger.info(
            "phi_torch_jit: dropped the least recently used specialization of %s: %s",
            self.owner,
            describe_spec(dropped.key[0]),
        )

    def runs_eagerly(self, reason: str) -> str:
        """Log (once per jitted function) that a specialization runs eagerly; return ``reason``."""
        if not self._eager_logged:
            self._eager_logged = True
            logger.warning("phi_torch_jit: %s runs eagerly: %s", self.owner, reason)
        return reason

    gave_up_reason = ""
    """Why the whole function runs eagerly (its calls keep missing the cache)."""

    def gave_up(self, misses: int, window: int) -> None:
        """Log that the function stops compiling: its specializations are not reused."""
        self.gave_up_reason = (
            f"{misses} of its last {window} calls or fewer each compiled a new specialization "
            "(shapes, static values or branches that do not repeat); compiling costs more "
            "than it saves, so every call runs the Python function (jit(fallback='off') "
            "keeps compiling)"
        )
        logger.warning("phi_torch_jit: %s runs eagerly: %s", self.owner, self.gave_up_reason)
        self.cannot_compile([self.gave_up_reason], stacklevel=5)

    def all_eager(self, specializations: int, calls: int) -> None:
        """Log that the function runs its Python directly: every specialization is eager."""
        self.gave_up_reason = (
            f"each of its {specializations} specialization(s) runs eagerly and served its last "
            f"{calls} calls, so calls skip the signature lookup and run the Python function "
            "(jit(fallback='off') keeps compiling)"
        )
        logger.warning("phi_torch_jit: %s runs eagerly: %s", self.owner, self.gave_up_reason)

    def switched(self, figures: str) -> None:
        """Log that a specialization serves eager code: its compiled step is slower."""
        logger.warning("phi_torch_jit: %s: a specialization %s", self.owner, figures)

    def paths_switched(self, figures: str) -> None:
        """Log that a signature's several paths serve eager code (or again their programs):
        the programs that ran in vain cost more than compiling saves."""
        logger.warning("phi_torch_jit: %s: a signature with several paths: %s", self.owner, figures)

    def cannot_compile(self, reasons: list[str], stacklevel: int = 6) -> None:
        """Warn once that the function runs eagerly, and why: it does what no compiled program
        repeats, or compiling it does not pay. ``stacklevel`` points at the user's call."""
        if self._cannot_compile_warned:
            return
        self._cannot_compile_warned = True
        warnings.warn(
            JitWarning(f"phi_torch_jit: {self.owner} runs eagerly: {'; '.join(reasons)}."),
            stacklevel=stacklevel,
        )

    def unguarded(self, reads: Sequence[Read]) -> None:
        """Log (at each trace) what the traced call read that no guard covers."""
        for read in reads:
            if read.unguarded:
                logger.warning(
                    "phi_torch_jit: %s reads %s (at %s), whose %s are not guarded: a change "
                    "there is not seen until something else retraces (explain() lists it)",
                    self.owner, read.source.label, read.source.location, read.unguarded,
                )  # fmt: skip

    def side_effects(self, seen: list[str]) -> None:
        """Warn once about Python side effects that compiled calls skip."""
        if self._side_effects_warned or not seen:
            return
        self._side_effects_warned = True
        warnings.warn(
            JitWarning(
                f"phi_torch_jit: {self.owner} has Python side effects ({', '.join(seen)}) that "
                "ran while it was compiled but will not run on compiled calls, which execute no "
                "Python. Move them outside the jitted function, return the values instead, or "
                "use engine='eager' while debugging."
            ),
            stacklevel=5,
        )

    def guard_error(self, description: str) -> GuardError:
        """The error for a failed value guard under ``on_guard_failure="error"``."""
        return GuardError(
            f"phi_torch_jit: {self.owner} branched on a tensor value that changed since it was "
            f"traced: {description}. The compiled program would return the traced branch's "
            "result. Use jit(on_guard_failure='retrace') (the default) or 'eager', or replace "
            "the Python branch by tensor operations (torch.where)."
        )

    def tracer_warnings(self, module: CompiledModule) -> tuple[str, ...]:
        """Pass the tracer warnings on to the user; return their descriptions for explain()."""
        reemit(module.tracer_warnings)
        return tuple(describe_warning(w) for w in module.tracer_warnings)
