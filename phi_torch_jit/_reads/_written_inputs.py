"""Arguments the function writes in place (``x.add_(1)``, ``state[i] = v``).

Found by the record pass: a tensor argument whose version counter moved during that eager
run is written by the function. Two things follow (NOTE [arguments written in place]):

- A compiled call may fail a value guard after its program ran: the program's writes to the
  arguments are undone before the next specialization, or the record pass, runs on them
  (without it, a retrace saw ``x + 1`` where eager saw ``x``, silently).
- Which arguments share memory (``f(x, x)``, ``f(x, x[0])``) is part of what the program was
  built for: a graph captured with separate arguments reads the old value of the other one.
  A call whose sharing differs from the trace's is a miss; engines that capture a graph run
  a specialization eagerly when an argument it writes shares memory with another.

Nothing of this runs for functions that write no argument.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._compat import storage_pointer

__all__ = ["WrittenInputs", "versions", "written_inputs", "sharing", "aliased"]


def versions(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The version counters of ``tensors`` (each in-place write moves its tensor's); -1 for
    an inference tensor (made under ``torch.inference_mode``), which has none: such a
    tensor cannot be written outside inference mode, and inside it autograd records nothing
    that a write could invalidate."""
    return [-1 if t.is_inference() else t._version for t in tensors]


def sharing(tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """For each tensor, the index of the first tensor using the same storage (itself if
    none before it does); tensors without storage (empty) share with nobody."""
    first: dict[int, int] = {}
    groups = []
    for i, t in enumerate(tensors):
        pointer = storage_pointer(t)
        groups.append(first.setdefault(pointer, i) if pointer else i)
    return tuple(groups)


@dataclass(frozen=True)
class WrittenInputs:
    """The arguments a specialization writes and how its arguments shared memory."""

    indices: tuple[int, ...]
    """Positions (among the flat tensor arguments) the function writes in place."""
    shared: tuple[int, ...]
    """:func:`sharing` of the arguments the specialization was built with."""

    @property
    def aliased(self) -> bool:
        """Whether a written argument shares memory with another argument."""
        return any(self.shared[i] != i or self.shared.count(i) > 1 for i in self.indices)

    def same_sharing(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether the arguments of a call share memory as the built-with ones did."""
        return sharing(tensors[: len(self.shared)]) == self.shared

    def save(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of the written arguments, taken before a program runs."""
        return [tensors[i].detach().clone() for i in self.indices]

    def restore(self, tensors: Sequence[torch.Tensor], saved: list[torch.Tensor]) -> None:
        """Undo a program's writes (a value guard failed after it ran)."""
        with torch.no_grad():
            for i, value in zip(self.indices, saved):
                tensors[i].copy_(value)

    def describe(self) -> str:
        """Which arguments it writes, for logs and retrace reasons."""
        return ", ".join(f"tensor argument {i}" for i in self.indices)


def written_inputs(tensors: Sequence[torch.Tensor], before: list[int]) -> WrittenInputs | None:
    """What the record pass wrote of ``tensors`` (their versions were ``before``); None if
    it wrote none of them."""
    indices = tuple(
        i for i, (t, v) in enumerate(zip(tensors, before)) if v != -1 and t._version != v
    )
    return WrittenInputs(indices, sharing(tensors)) if indices else None


def aliased(written: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> bool:
    """Whether a tensor the record pass wrote in place shares memory with another of a
    program's ``inputs``, or is two of them (arguments, captured tensors, parameters:
    ``cache["v"] = w.detach()`` kept from an earlier call, then ``cache["v"].mul_(0.5)``; a
    list holding ``w`` twice): a captured graph takes them as separate inputs and reads the
    other one's old value."""
    if not written:
        return False
    places: dict[int, int] = {}  # storage -> how many inputs use it (the same tensor
    for tensor in inputs:  # held twice, PARTS = [w, w], is two inputs: probe 36c)
        pointer = storage_pointer(tensor)
        if pointer:
            places[pointer] = places.get(pointer, 0) + 1
    return any(places.get(storage_pointer(t), 0) > 1 for t in written)
