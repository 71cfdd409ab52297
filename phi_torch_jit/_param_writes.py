"""The record phase's watch on parameters the step writes (see :mod:`._unguardable`, whose
torch-function mode calls it for every torch call of the record pass).

A parameter written in place inside the step (``p.add_(...)`` under ``no_grad``, ``p[i] = v``,
a foreach update, ``out=p``) is noted *before* the write, its value kept
(``StateSnapshot.before_write``): the trace is rewound past the write, as buffers are, and
does not write it a second time (it did: twice per call on the default engine, three times on
"compile", with the warm-up run). A parameter whose ``requires_grad`` the step changes is a
reason to run eagerly (:func:`freezes`).
"""

from __future__ import annotations

from typing import Any

import torch

from ._compat import view_base
from ._context import Phase, current_frame

__all__ = ["before_writes", "freezes", "IN_PLACE_DUNDERS", "REQUIRES_GRAD"]

REQUIRES_GRAD = torch.Tensor.requires_grad
"""The attribute's descriptor: a read reaches a torch-function mode as a call of its
``__get__``, a write as its ``__set__``."""


def before_writes(func: Any, args: tuple[Any, ...], kwargs: Any) -> None:
    """Parameters ``func`` writes in place (``p.add_``, ``p[i] = v``, ``p += v``, a foreach op
    over parameters, ``out=p``), directly or through a view (``w[0].mul_(2)``), are noted
    before the write: the trace is rewound past it."""
    name = getattr(func, "__name__", "")
    in_place = (name.endswith("_") and not name.endswith("__")) or name in IN_PLACE_DUNDERS
    targets = list(args[:1]) if in_place else []
    if targets and isinstance(targets[0], (list, tuple)):  # torch._foreach_add_(params, ...)
        targets = list(targets[0])
    if kwargs and kwargs.get("out") is not None:
        out = kwargs["out"]
        targets += list(out) if isinstance(out, (list, tuple)) else [out]
    written = [p for p in map(_parameter_of, targets) if p is not None]
    frame = current_frame() if written else None
    if frame is not None and frame.phase is Phase.RECORD and frame.recording is not None:
        for parameter in written:
            frame.recording.before_write(parameter)


IN_PLACE_DUNDERS = frozenset(
    ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
     "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
     "__imatmul__")
)  # fmt: skip
"""Tensor methods that write their tensor (``p[i] = v``, ``p += v``)."""


def _parameter_of(target: Any) -> torch.nn.Parameter | None:
    """The parameter ``target`` is, or is a view of (``w[0].mul_(2)``, ``w.T.add_``)."""
    if isinstance(target, torch.Tensor) and not isinstance(target, torch.nn.Parameter):
        target = view_base(target)
    return target if isinstance(target, torch.nn.Parameter) else None


def freezes(func: Any, args: tuple[Any, ...]) -> bool:
    """``p.requires_grad_(...)`` or ``p.requires_grad = ...`` on a parameter."""
    setter = getattr(func, "__self__", None) is REQUIRES_GRAD and func.__name__ == "__set__"
    named = getattr(func, "__name__", "") == "requires_grad_"
    return (setter or named) and bool(args) and isinstance(args[0], torch.nn.Parameter)
