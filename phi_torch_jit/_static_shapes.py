"""Ops whose output size depends on tensor values, traced in a form of static shape.

A captured graph (engines "compile" and "auto") bakes every size. ``x[mask]``, ``nonzero``,
``torch.where(mask)``, ``masked_select`` and ``repeat_interleave`` with tensor repeats give an
output whose size depends on values, so the graph would be right for one size only. While the
wrapper is traced, each such op is recorded in a form whose shape is static, for the size this
call produced (a boolean index becomes the columns of ``nonzero_static(mask, size=K)``), and
the size, computed in the graph as a tensor (``count_nonzero(mask)``), becomes a value guard
(:mod:`._value_guards`): a call whose size differs fails the guard, its result is discarded
and the function retraces for the new size, as for a branch on a value. The static forms
never read out of bounds whatever the size (``nonzero_static`` pads with index -1 or
truncates), so a call with another size runs to its guard. See NOTE [value-dependent sizes].

This module knows ATen ops only; the trace hook that calls it is :mod:`._value_guards`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._compat import disable_dispatch_modes

__all__ = ["SizeGuard", "sized_op", "static_form"]

aten = torch.ops.aten


def sized_op(func: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a static form's op ``func`` is the one that holds the size it was traced for."""
    if func is aten.nonzero_static.default:
        return True
    return func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor) and (
        kwargs.get("output_size") is not None
    )


TraceOp = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]
"""Records one ATen op in the graph being traced and returns its (real) result."""


@dataclass(frozen=True)
class SizeGuard:
    """A size the traced graph was specialized for."""

    tensor: torch.Tensor
    """0-dim integer tensor computed in the graph: the size in each call."""
    value: int
    """The size in the traced call."""
    what: str
    """Which size, for messages (``the number of True entries of a boolean index``)."""


def _count(trace: TraceOp, mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    with disable_dispatch_modes():
        value = int(torch.count_nonzero(mask))
    return trace(aten.count_nonzero.default, (mask,), {}), value


def _columns(trace: TraceOp, mask: torch.Tensor, size: int) -> list[torch.Tensor]:
    """The index tensors equivalent to ``mask`` in an index, for ``size`` True entries."""
    where = trace(aten.nonzero_static.default, (mask,), {"size": size, "fill_value": -1})
    return [trace(aten.select.int, (where, 1, d), {}) for d in range(mask.dim())]


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _index(trace: TraceOp, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    source, indices = args
    if not any(_is_mask(i) for i in indices):
        return None
    guards, static = [], []
    for index in indices:
        if not _is_mask(index):
            static.append(index)
            continue
        count, size = _count(trace, index)
        guards.append(SizeGuard(count, size, "the number of True entries of a boolean index"))
        static.extend(_columns(trace, index, size))
    return trace(aten.index.Tensor, (source, static), {}), guards


def _nonzero(trace: TraceOp, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    (source,) = args
    count, size = _count(trace, source)
    guard = SizeGuard(count, size, "the number of nonzero entries (nonzero)")
    where = trace(aten.nonzero_static.default, (source,), {"size": size, "fill_value": -1})
    return where, [guard]


def _nonzero_numpy(trace: TraceOp, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    (source,) = args
    if source.dim() == 0:
        return None
    count, size = _count(trace, source)
    guard = SizeGuard(count, size, "the number of nonzero entries (torch.where(mask))")
    return _columns(trace, source, size), [guard]


def _masked_select(trace: TraceOp, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    source, mask = args
    shape = list(torch.broadcast_shapes(source.shape, mask.shape))
    source = trace(aten.expand.default, (source, shape), {})
    mask = trace(aten.expand.default, (mask, shape), {})
    count, size = _count(trace, mask)
    guard = SizeGuard(count, size, "the number of True entries of masked_select's mask")
    return trace(aten.index.Tensor, (source, _columns(trace, mask, size)), {}), [guard]


def _repeats_total(
    trace: TraceOp, repeats: torch.Tensor, per_repeat: int
) -> tuple[SizeGuard, int] | None:
    if repeats.device.type != "cpu":  # the check of output_size is CPU's (NOTE)
        return None
    with disable_dispatch_modes():
        total = int(repeats.sum())
    guard = SizeGuard(
        trace(aten.sum.default, (repeats,), {}), total, "the sum of repeat_interleave's repeats"
    )
    return guard, total * per_repeat


def _repeat_interleave(trace: TraceOp, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    if kwargs.get("output_size") is not None:
        return None
    (repeats,) = args
    found = _repeats_total(trace, repeats, 1)
    if found is None:
        return None
    guard, size = found
    out = trace(aten.repeat_interleave.Tensor, (repeats,), {**kwargs, "output_size": size})
    return out, [guard]


def _repeat_interleave_self(trace: TraceOp, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    source, repeats, *rest = args
    options = dict(zip(("dim", "output_size"), rest), **kwargs)
    if options.get("output_size") is not None:
        return None
    dim = options.get("dim")
    extent = source.numel() if dim is None else source.size(dim)
    found = _repeats_total(trace, repeats, extent if repeats.numel() == 1 else 1)
    if found is None:
        return None
    guard, size = found
    options["output_size"] = size
    out = trace(aten.repeat_interleave.self_Tensor, (source, repeats), options)
    return out, [guard]


_FORMS: dict[Any, Callable[[TraceOp, Sequence[Any], dict[str, Any]], Any]] = {
    aten.index.Tensor: _index,
    aten.nonzero.default: _nonzero,
    aten.argwhere.default: _nonzero,
    aten.nonzero_numpy.default: _nonzero_numpy,
    aten.where.default: _nonzero_numpy,  # torch.where(condition)
    aten.masked_select.default: _masked_select,
    aten.repeat_interleave.Tensor: _repeat_interleave,
    aten.repeat_interleave.self_Tensor: _repeat_interleave_self,
}


def static_form(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], trace: TraceOp
) -> tuple[Any, list[SizeGuard]] | None:
    """Trace ``func(*args, **kwargs)`` in a form of static shape with ``trace``: its result and
    the sizes it was specialized for; None where the op's output size does not depend on
    values (or no static form is known: the graph keeps the op, and the capture refuses it)."""
    form = _FORMS.get(func)
    if form is None:
        return None
    result: tuple[Any, list[SizeGuard]] | None = form(trace, args, kwargs)
    return result
