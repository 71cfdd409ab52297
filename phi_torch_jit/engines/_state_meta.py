"""What a compiled program fixed of the parameters and buffers it reads as inputs.

A program compiled for parameters of one dtype, device and ``requires_grad`` is wrong for
others: its backward gives a parameter frozen or unfrozen since no gradient, or one nobody
wants, and inductor's kernels read a storage of another dtype as the old one (garbage, or past
its end: ``module.double()``, ``.to()``, ``p.data = p.data.half()`` keep the parameter objects,
so the module guard's identity checks hold). Engines check :func:`fixed_of` before each call of
a compiled program (NOTE [module guards]).
"""

from __future__ import annotations

import operator
from typing import Any

import torch

__all__ = ["Fixed", "StateChanged", "fixed_of", "same_placement"]

Fixed = tuple[tuple[bool, Any, Any], ...]
"""Per tensor: ``requires_grad``, dtype, device."""


class StateChanged(RuntimeError):
    """A compiled program was called with parameters or buffers whose ``requires_grad``,
    dtype or device differ from its compile's; the specialization retraces (the module
    guard's :meth:`moved` sees it)."""


_FIXED = operator.attrgetter("requires_grad", "dtype", "device")


def fixed_of(tensors: tuple[torch.Tensor, ...]) -> Fixed:
    """Each tensor's ``requires_grad``, dtype and device: what a compiled program fixed for
    parameters and buffers (one C ``map``; 4 parameters: about 0.5 us for ``requires_grad``
    alone, 1.3 us with dtype and device on a loaded machine)."""
    return tuple(map(_FIXED, tensors))


def same_placement(now: Fixed, then: Fixed, owner: str) -> None:
    """Raise :class:`StateChanged` where a dtype or device in ``now`` differs from ``then``
    (two :func:`fixed_of`); ``requires_grad`` alone may differ."""
    if any(a[1:] != b[1:] for a, b in zip(now, then, strict=True)):
        raise StateChanged(
            f"phi_torch_jit: {owner}: a parameter's dtype or device changed since the compile"
        )
