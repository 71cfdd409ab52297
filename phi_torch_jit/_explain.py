"""The readable report of ``JitFunction.explain()``, one specialization at a time."""

from __future__ import annotations

from ._signature import describe_spec
from ._specialization import Specialization

__all__ = ["explain_specialization"]


def explain_specialization(index: int, spec: Specialization) -> list[str]:
    grad = "grad enabled" if spec.key[1] else "grad disabled"
    t = spec.timings
    lines = [
        f"[{index}] {describe_spec(spec.key[0])}, {grad}",
        f"    modules: {', '.join(spec.modules) or 'none'}"
        + (f" ({len(spec.guard.modules)} guarded)" if spec.guard else ""),
        f"    times: record {t.record * 1e3:.1f} ms, compile custom functions "
        f"{t.compile_custom * 1e3:.1f} ms, trace {t.trace * 1e3:.1f} ms",
    ]
    lines += [f"    engine: {note}" for note in spec.engine_notes]
    if spec.eager_reason:
        lines.append(f"    runs eagerly: {spec.eager_reason}")
    elif not spec.calls:
        lines.append("    custom functions: none")
    for call in spec.calls:
        forward = call.forward.mode + (f" ({call.forward.reason})" if call.forward.reason else "")
        lines.append(f"    custom function {call.function.label} as op {call.op_name}:")
        lines.append(f"      forward: {forward}")
        backwards = call.backward.specializations
        if not backwards:
            lines.append("      backward: not compiled yet (compiled at the first backward)")
        for pattern, b in backwards.items():
            reason = (
                f" ({b.compiled.reason})" if b.compiled is not None and b.compiled.reason else ""
            )
            lines.append(f"      backward for needs_input_grad={pattern}: {b.mode}{reason}")
    lines += [f"    value guard: {g.describe()}" for g in spec.value_guards]
    lines += [f"    tracer warning: {w}" for w in spec.tracer_warnings]
    return lines
