"""Classes registered with ``torch.utils._pytree`` as arguments and results of jitted functions.

A small adapter written against :mod:`phi_torch_jit.extend` alone (docs/extending.md walks
through it). A class the user registered with torch's pytree (``register_pytree_node``) and
named here with :func:`register_pytree_values` is taken apart with ``tree_flatten``: its tensor
leaves are traced, everything else (the tree's structure and context, non-tensor leaves, the
tensors' shapes, dtypes, devices and requires_grad) is the cache key, so a change there
retraces. Results of that class are rebuilt with ``tree_unflatten``.

Example:
    >>> torch.utils._pytree.register_pytree_node(Particles, flatten_particles, unflatten_particles)
    >>> phi_torch_jit.adapters.pytree.register_pytree_values(Particles)
    >>> step = phi_torch_jit.jit(step)   # step(p: Particles) -> Particles
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

import torch

from .._compat import pytree
from ..errors import SignatureError
from ..extend import ValueType, register_values

__all__ = ["register_pytree_values", "PytreeKey", "PYTREE_VALUES"]

_CLASSES: set[type] = set()


def register_pytree_values(cls: type) -> None:
    """Accept instances of ``cls`` (registered with ``torch.utils._pytree``) as arguments and
    results of jitted functions: tensor leaves traced, the rest keyed.

    Raises:
        TypeError: ``cls`` is not a class registered with ``torch.utils._pytree``.
    """
    if not isinstance(cls, type) or cls not in pytree().SUPPORTED_NODES:
        raise TypeError(
            f"phi_torch_jit: {cls!r} is not registered with torch.utils._pytree; register it "
            "with torch.utils._pytree.register_pytree_node first"
        )
    _CLASSES.add(cls)


class PytreeKey:
    """A pytree value's static part: its structure, its non-tensor leaves, its tensors' meta."""

    __slots__ = ("_hash", "constants", "metas", "spec")

    def __init__(self, spec: Any, constants: tuple[Any, ...], metas: tuple[Any, ...]) -> None:
        self.spec = spec
        self.constants = constants
        """Per leaf: None for a tensor (traced), else ``(value,)``."""
        self.metas = metas
        """Shape, dtype, device and requires_grad of each tensor leaf."""
        self._hash = hash((spec.type, constants, metas))  # cheap: every call hashes a key

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PytreeKey):
            return NotImplemented
        return (
            self.metas == other.metas
            and self.constants == other.constants
            and bool(self.spec == other.spec)
        )

    def difference(self, other: PytreeKey) -> str:
        """What differs from ``other``, e.g. ``leaf 2: 0.1 -> 0.2``."""
        for i, (old, new) in enumerate(zip(self.constants, other.constants)):
            if old != new:
                return f"leaf {i}: {_leaf(old)} -> {_leaf(new)}"
        if self.metas != other.metas:
            return f"tensor leaves: {self.metas} -> {other.metas}"
        return f"structure: {self.spec} -> {other.spec}"

    def __repr__(self) -> str:
        return f"pytree[{self.spec}]"


def _leaf(constant: tuple[Any, ...] | None) -> str:
    return "tensor" if constant is None else repr(constant[0])


def _flatten(obj: Any, tensors: list[torch.Tensor]) -> Hashable:
    leaves, spec = pytree().tree_flatten(obj)
    constants: list[Any] = []
    metas = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            constants.append(None)
            metas.append((tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad))
        else:
            try:
                hash(leaf)
            except TypeError:
                raise SignatureError(
                    f"phi_torch_jit: a leaf of a {type(obj).__qualname__} argument is an "
                    f"unhashable {type(leaf).__qualname__}, which cannot be part of the cache "
                    "key; make it a tensor or a hashable value"
                ) from None
            constants.append((leaf,))
    return PytreeKey(spec, tuple(constants), tuple(metas))


def _unflatten(key: Any, tensors: Iterator[torch.Tensor]) -> Any:
    leaves = [next(tensors) if c is None else c[0] for c in key.constants]
    return pytree().tree_unflatten(leaves, key.spec)


PYTREE_VALUES = ValueType("torch pytree", lambda obj: type(obj) in _CLASSES, _flatten, _unflatten)
"""Instances of the classes named with :func:`register_pytree_values`."""

register_values(PYTREE_VALUES)
