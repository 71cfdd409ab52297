"""Stage 0, said: a spec (:mod:`._signature`) as text, and where two specs first differ
(``dt: 0.1 -> 0.2``), for :meth:`JitFunction.explain` and the retrace log."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._signature import Spec

__all__ = ["describe_spec", "first_difference"]


def describe_spec(spec: Spec) -> str:
    """A short human-readable form of a spec, e.g. ``(Tensor[32, 32] float32 cpu, dt=0.1)``."""
    tag = spec[0]
    if tag == "A":
        parts = [describe_spec(c) for c in spec[1]]
        parts += [f"{n}={describe_spec(c)}" for n, c in zip(spec[2], spec[3])]
        return "(" + ", ".join(parts) + ")"
    if tag == "T":
        if len(spec) == 1:
            return "Tensor"
        shape = ", ".join(map(str, spec[1]))
        grad = " requires_grad" if spec[4] else ""
        return f"Tensor[{shape}] {str(spec[2]).replace('torch.', '')} {spec[3]}{grad}"
    if tag == "S":
        return repr(spec[2])
    if tag == "I":
        return f"{spec[1].__name__} (computed)"
    if tag == "M":
        return f"<{type(spec[1]).__name__} module>"
    if tag == "X":
        return repr(spec[2])
    children = spec[-1]
    inner = ", ".join(describe_spec(c) for c in children)
    if tag == "D":
        inner = ", ".join(f"{k!r}: {describe_spec(c)}" for k, c in zip(spec[2], children))
        return "{" + inner + "}"
    if tag == "Q":
        return f"[{inner}]" if spec[1] is list else f"{spec[1].__name__}({inner})"
    return f"{spec[1].__name__}({inner})"


def first_difference(old: Spec, new: Spec, arg_names: Sequence[str] = ()) -> str:
    """Say where two argument specs first differ, e.g. ``dt: 0.1 -> 0.2``."""
    _, old_pos, old_names, old_kw = old
    _, new_pos, new_names, new_kw = new
    if len(old_pos) != len(new_pos) or old_names != new_names:
        return f"arguments: {describe_spec(old)} -> {describe_spec(new)}"
    for i, (a, b) in enumerate(zip(old_pos, new_pos)):
        found = _difference(a, b, arg_names[i] if i < len(arg_names) else f"args[{i}]")
        if found:
            return found
    for name, a, b in zip(new_names, old_kw, new_kw):
        found = _difference(a, b, name)
        if found:
            return found
    return "nothing (same signature)"


def _shown(key: Any) -> str:
    """An attribute's key in :func:`plain_attributes` as the value it stands for (numbers
    and lists are keyed by their ``repr()``)."""
    return key if isinstance(key, str) else repr(key)


def _difference(a: Spec, b: Spec, path: str) -> str | None:
    if a == b:
        return None
    if a[0] != b[0] or a[0] in ("T", "S", "M", "X") or a[:-1] != b[:-1]:
        if a[0] == b[0] == "T":
            fields = ("shape", "dtype", "device", "requires_grad", "strides", "type", "inference",
                      "is_leaf", "conj and neg bits", "attributes")  # fmt: skip
            changes = [f"{f} {x} -> {y}" for f, x, y in zip(fields, a[1:], b[1:]) if x != y]
            return f"{path}: " + ", ".join(changes)
        if a[0] == b[0] == "S" and len(a) == len(b) == 4 and a[2] is b[2]:
            now = dict(b[3])
            changed = [f"{n} {_shown(v)} -> {_shown(now.get(n, '<deleted>'))}"
                       for n, v in a[3] if now.get(n, object()) != v]  # fmt: skip
            return f"{path}: attribute " + ", ".join(changed or ["added"])
        if a[0] == b[0] == "X" and a[1] == b[1] and hasattr(a[2], "difference"):
            return f"{path}: {a[2].difference(b[2])}"
        return f"{path}: {describe_spec(a)} -> {describe_spec(b)}"
    labels: Sequence[Any] = range(len(a[-1]))
    if a[0] in ("D", "C"):
        labels = a[2]
    elif a[0] == "N":
        labels = a[1]._fields
    for label, x, y in zip(labels, a[-1], b[-1]):
        step = f".{label}" if a[0] in ("C", "N") else f"[{label!r}]"
        found = _difference(x, y, path + step)
        if found:
            return found
    return None
