"""Ops whose output size depends on tensor values, traced in a form of static shape.

A captured graph (engines "compile" and "auto") bakes every size. ``x[mask]``, ``nonzero``,
``torch.where(mask)``, ``masked_select``, ``repeat_interleave`` with tensor repeats, ``unique``
and ``bincount`` give an output whose size depends on values, so the graph would be right for
one size only. While the wrapper is traced, each such op is recorded in a form whose shape is
static, for the size this call produced (a boolean index becomes the columns of
``nonzero_static(mask, size=K)``), and the size, computed in the graph as a tensor
(``count_nonzero(mask)``), becomes a value guard (:mod:`._value_guards`): a call whose size
differs fails the guard, its result is discarded and the function retraces for the new size,
as for a branch on a value. The static forms never read out of bounds whatever the size
(``nonzero_static`` pads with index -1 or truncates; ``unique`` and ``bincount`` clamp), so a
call with another size runs to its guard. See NOTE [value-dependent sizes].

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


def _not_negative(trace: TraceOp, source: torch.Tensor, what: str) -> SizeGuard:
    """A guard that ``source`` holds no negative value (the static forms clamp indices; eager
    raises for a negative one: a call with one fails the guard, and its retrace raises)."""
    least = trace(aten.amin.default, (source, [0]), {})
    return SizeGuard(trace(aten.clamp_max.default, (least, 0), {}), 0, what)


def _bincount(trace: TraceOp, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``bincount(x, weights, minlength)``: ``max(minlength, max(x) + 1)`` bins, guarded, and
    the counts added into zeros at clamped indices (``index_add``). Not for weights that
    require grad: bincount has no backward (eager raises at the backward; ``index_add`` would
    not)."""
    source, *rest = args
    options = dict(zip(("weights", "minlength"), rest), **kwargs)
    weights, minlength = options.get("weights"), int(options.get("minlength") or 0)
    if source.dim() != 1 or source.numel() == 0:
        return None
    if weights is not None and weights.requires_grad:
        return None  # eager's bincount has no backward: it raises there, ours would not
    with disable_dispatch_modes():
        if int(source.min()) < 0:
            return None  # the op raises: let it, as eagerly
        bins = max(minlength, int(source.max()) + 1)
        dtype = torch.bincount(source[:1], None if weights is None else weights[:1]).dtype
    top = trace(aten.amax.default, (source, [0]), {})
    needed = trace(aten.clamp_min.default, (trace(aten.add.Tensor, (top, 1), {}), minlength), {})
    guards = [
        SizeGuard(needed, bins, "the number of bins of bincount (its largest value + 1)"),
        _not_negative(trace, source, "bincount's smallest value, if negative"),
    ]
    where = trace(aten.clamp.default, (source, 0, bins - 1), {})
    if weights is None:
        added = trace(aten.ones_like.default, (source,), {"dtype": dtype})
    else:
        added = trace(aten._to_copy.default, (weights,), {"dtype": dtype})
    zeros = trace(aten.zeros.default, ([bins],), {"dtype": dtype, "device": source.device})
    return trace(aten.index_add.default, (zeros, 0, where, added), {}), guards


def _unique_sorted(
    trace: TraceOp, source: torch.Tensor, counted: bool
) -> tuple[Any, list[SizeGuard]] | None:
    """Sorted unique values of an integral or boolean tensor, the inverse (shaped like
    ``source``) and the counts, for the number of distinct values of this call, guarded: the
    sorted values, a flag where each new value starts, its running sum as group ids, and the
    values, inverse and counts scattered by those (clamped) ids."""
    if source.dtype.is_floating_point or source.is_complex() or source.numel() == 0:
        return None
    size = source.numel()
    flat = trace(aten.reshape.default, (source, [size]), {}) if source.dim() != 1 else source
    ordered, order = trace(aten.sort.default, (flat,), {})
    changes = trace(
        aten.ne.Tensor,
        (trace(aten.slice.Tensor, (ordered, 0, 1, size), {}),
         trace(aten.slice.Tensor, (ordered, 0, 0, size - 1), {})),
        {},
    )  # fmt: skip
    first = trace(aten.ones.default, ([1],), {"dtype": torch.bool, "device": source.device})
    starts = trace(aten.cat.default, ([first, changes],), {})
    count = trace(aten.sum.default, (starts,), {"dtype": torch.int64})
    with disable_dispatch_modes():
        distinct = int(torch.unique(source).numel())
    group = trace(aten.sub.Tensor, (trace(aten.cumsum.default, (starts, 0), {}), 1), {})
    slot = trace(aten.clamp.default, (group, 0, distinct - 1), {})
    device = source.device
    values = trace(
        aten.scatter.src,
        (trace(aten.zeros.default, ([distinct],), {"dtype": source.dtype, "device": device}),
         0, slot, ordered),
        {},
    )  # fmt: skip
    inverse = trace(
        aten.scatter.src,
        (trace(aten.zeros.default, ([size],), {"dtype": torch.int64, "device": device}),
         0, order, group),
        {},
    )  # fmt: skip
    inverse = trace(aten.reshape.default, (inverse, list(source.shape)), {})
    counts = None
    if counted:
        ones = trace(aten.ones.default, ([size],), {"dtype": torch.int64, "device": device})
        zeros = trace(aten.zeros.default, ([distinct],), {"dtype": torch.int64, "device": device})
        counts = trace(aten.index_add.default, (zeros, 0, slot, ones), {})
    guard = SizeGuard(count, distinct, "the number of distinct values (unique)")
    return (values, inverse, counts), [guard]


def _empty_int(trace: TraceOp, like: torch.Tensor) -> Any:
    return trace(aten.empty.memory_format, ([0],), {"dtype": torch.int64, "device": like.device})


def _unique2(trace: TraceOp, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``torch.unique(x, sorted=True, ...)`` without ``dim``; unsorted is left to the op (its
    order is the implementation's)."""
    source, *rest = args
    options = dict(zip(("sorted", "return_inverse", "return_counts"), rest), **kwargs)
    if not options.get("sorted", True):
        return None
    found = _unique_sorted(trace, source, bool(options.get("return_counts")))
    if found is None:
        return None
    (values, inverse, counts), guards = found
    if not options.get("return_inverse"):
        inverse = _empty_int(trace, source)
    return (values, inverse, counts if counts is not None else _empty_int(trace, source)), guards


def _unique_dim(trace: TraceOp, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``torch.unique(x, dim=d)`` of a 1-d tensor (PhiML's sparse matrices: ``axis=-1``): the
    same as without ``dim``; it returns the inverse and counts whether asked or not."""
    source, dim, *_ = args
    if source.dim() != 1 or dim not in (0, -1):
        return None
    return _unique_sorted(trace, source, True)


_FORMS: dict[Any, Callable[[TraceOp, Sequence[Any], dict[str, Any]], Any]] = {
    aten.bincount.default: _bincount,
    aten._unique2.default: _unique2,
    aten.unique_dim.default: _unique_dim,
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
