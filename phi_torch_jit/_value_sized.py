"""Sizes that come from tensor values, and whether the traced Python read them.

The static forms of :mod:`._static_shapes` specialize a captured graph for the size one call
produced (how many entries ``nonzero`` found) and guard it: a program whose counts change on
every call (an ODE solver evaluating the output times each step passed) retraced on every call,
and ran eagerly. Often the Python never looks at such a size: the indices only flow into other
ops (``y[idx] = f(t[idx])``), and the graph would be right for any count if the op kept its
dynamic form.

While the wrapper is traced, this module keeps, in the frame's :class:`._context.ValueSized`,
the tensors whose sizes come from values (the static forms' results, and what ops compute from
them), and notes every Python read of one of their sizes (``len(idx)``, ``x.shape``,
``x.size(0)``, ``x.numel()``; by torch's Python too, ``F.interpolate`` reading its input's
shape): such a read ends in a literal of the graph or in a branch, so the size stays guarded.
Reads made by the tracing machinery itself (FX, fake tensors, this package) do not count.
The engine is told through the graph: each node that holds a static form's size carries
:data:`SIZED_NODE` in its meta, empty while nothing read a size, else where the first read was.
Where nothing read them, the engine may capture the ops in their dynamic form and drop the
size guards, once the graph checks out with symbolic sizes
(:mod:`.engines._generic_sizes`). NOTE [value-dependent sizes].

The size reads are watched by patching ``torch.Tensor``'s ``shape``, ``size``, ``numel``,
``nelement`` and ``__len__`` from a trace's first value-dependent size to its end only.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from ._compat import tensor_conversion
from ._context import Frame, Phase, ValueSized, current_frame
from ._patches import RefCounted, TensorAttributes
from ._sources import OWN_DIR, TORCH_DIR

__all__ = ["SIZED_NODE", "note_sized", "note_sized_node", "propagate_sized", "stop_watching"]

SIZED_NODE = "phi_torch_jit.value_sized"
"""Meta key of the graph nodes a static form specialized for one size (``nonzero_static`` with
that size, ``repeat_interleave`` with that ``output_size``): the nodes an engine may put back
in their dynamic form. Its value: "" while no size was read, else where Python read one."""

_MACHINERY = (
    OWN_DIR,
    *(
        os.path.join(TORCH_DIR, part)
        for part in ("fx", "_subclasses", "_ops.py", "_library", "utils/_python_dispatch.py",
                     "utils/_pytree.py", "_guards.py", "_logging", "_prims_common",
                     "_meta_registrations.py", "_decomp")
    ),
)  # fmt: skip
"""Code whose size reads are bookkeeping, not the program's: FX and make_fx record tensor
metadata, fake tensors, the dispatcher's Python, this package (flattening the outputs)."""

_SAME_SHAPE_AS_FIRST = ("index_put", "index_add", "index_copy", "index_fill", "masked_fill",
                        "masked_scatter", "scatter", "scatter_add", "scatter_reduce",
                        "index_reduce", "copy")  # fmt: skip
"""Ops whose output has the shape of their first argument whatever the others (indices)."""


def _read(sized: ValueSized, where: str) -> None:
    """A value-dependent size was read: every size stays guarded (the nodes say so)."""
    sized.reads.append(where)
    for node in sized.nodes:
        node.meta[SIZED_NODE] = node.meta[SIZED_NODE] or where


def _note_read(tensor: torch.Tensor, caller: Any) -> None:
    frame = current_frame()
    if frame is None or frame.phase is not Phase.TRACE:
        return
    if id(tensor) not in frame.sized.tensors:
        return
    filename = caller.f_code.co_filename
    if not filename.startswith(_MACHINERY):
        _read(frame.sized, f"{filename}:{caller.f_lineno}")


def _watched(name: str) -> Any:
    base = tensor_conversion(name)
    if name == "shape":
        get = base.__get__

        def shape(self: torch.Tensor) -> torch.Size:
            _note_read(self, sys._getframe(1))
            return get(self)  # type: ignore[no-any-return]

        return property(shape)

    def read(self: torch.Tensor, *args: Any) -> Any:
        _note_read(self, sys._getframe(1))
        return base(self, *args)

    read.__name__ = name
    return read


_SIZE_READS = TensorAttributes(("shape", "size", "numel", "nelement", "__len__"), _watched)
_WATCH = RefCounted(_SIZE_READS.install, _SIZE_READS.remove)


def stop_watching(frame: Frame) -> None:
    """End of a trace: the size reads are no longer watched for it; its tensors are let go."""
    sized = frame.sized
    sized.tensors.clear()
    sized.nodes.clear()
    if sized.watching:
        sized.watching = False
        _WATCH.release()


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def note_sized(frame: Frame, result: Any) -> None:
    """``result`` (a static form's) has sizes that come from values: watch their reads."""
    sized = frame.sized
    if not sized.watching:
        _WATCH.acquire()
        sized.watching = True
    for tensor in _tensors(result):
        sized.tensors[id(tensor)] = tensor


def note_sized_node(frame: Frame, node: Any) -> None:
    """``node`` (an FX node) holds the size a static form was traced for."""
    node.meta[SIZED_NODE] = frame.sized.reads[0] if frame.sized.reads else ""
    frame.sized.nodes.append(node)


def propagate_sized(
    frame: Frame, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
) -> None:
    """An op ran in the trace: its outputs have value-dependent sizes if its inputs had (for
    ops that keep their first argument's shape, if that one had)."""
    tensors = frame.sized.tensors
    if not tensors:
        return
    packet = getattr(func, "__name__", str(func)).split(".")[0].rstrip("_")
    inputs = list(args[:1]) if packet in _SAME_SHAPE_AS_FIRST else [*args, *kwargs.values()]
    if any(id(t) in tensors for t in _tensors(inputs)):
        if str(func).startswith("phi_torch_jit"):  # compiled for the recorded shapes
            _read(frame.sized, f"{func} (a custom function given such a tensor)")
        for tensor in _tensors(out):
            tensors[id(tensor)] = tensor
