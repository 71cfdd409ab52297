"""Tensor state that a pass may change: the RNG streams and module buffers.

The record pass is the one real run of a cache miss; the trace pass must
leave no trace of its own. :class:`StateSnapshot` captures the RNG state and
the buffers of recorded modules *before* the record pass, and
:meth:`StateSnapshot.rewound` runs a block (the trace) from that state, then
puts back the state the record pass produced. See NOTE [side effects once]
in docs/design.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._compat import set_version_counters, version

__all__ = [
    "RngState",
    "capture_rng",
    "restore_rng",
    "rng_restored",
    "StateSnapshot",
    "BufferSlot",
    "buffer_slots",
    "put_back",
    "undone",
    "module_tensors",
]


@dataclass(frozen=True)
class RngState:
    """The global random number generator states."""

    cpu: torch.Tensor
    """State of the CPU generator."""
    cuda: tuple[torch.Tensor, ...]
    """State of each CUDA device's generator (empty when CUDA is not initialized)."""


def capture_rng() -> RngState:
    """Copy the global RNG states of the CPU and of every initialized CUDA device."""
    cuda: tuple[torch.Tensor, ...] = ()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = tuple(torch.cuda.get_rng_state_all())
    return RngState(torch.get_rng_state(), cuda)


def restore_rng(state: RngState) -> None:
    """Set the global RNG states back to ``state`` (inverse of :func:`capture_rng`)."""
    torch.set_rng_state(state.cpu)
    if state.cuda:
        torch.cuda.set_rng_state_all(list(state.cuda))


BufferSlot = tuple[nn.Module, str, torch.Tensor]
"""(module, buffer name, the buffer object it held)."""


def buffer_slots(modules: Sequence[nn.Module]) -> list[BufferSlot]:
    """Every buffer of ``modules`` and their submodules, with where it sits."""
    return [
        (owner, name, buffer)
        for root in modules
        for owner in root.modules()
        for name, buffer in owner._buffers.items()
        if buffer is not None
    ]


def put_back(
    slots: Sequence[BufferSlot], held: Mapping[tuple[int, str], torch.Tensor] | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(original, new) for each slot whose module now holds another tensor (a buffer replaced
    in forward); the original object is put back in the module.

    ``held``: (module id, name) -> the buffer the module held before the step. A module that
    holds it again was lent other tensors for a while (``torch.func.functional_call``, a
    swap of the user's): the slot saw a stand-in, and nothing was replaced."""
    replaced = []
    for owner, name, original in slots:
        current = owner._buffers.get(name)
        if held is not None and current is not None and held.get((id(owner), name)) is current:
            continue
        if current is not original and isinstance(current, torch.Tensor):
            owner._buffers[name] = original
            replaced.append((original, current))
    return replaced


def keep_buffer_objects(slots: Sequence[BufferSlot]) -> None:
    """After an eager run, put each buffer that forward replaced (``self.avg = 0.9 * self.avg
    + ...``) back as its original object holding the new value, as compiled calls leave it;
    one of another shape, dtype or device stays replaced. Else the module guard saw a new
    tensor after every eager call the meter timed, and retraced (43-59 traces during one
    inductor compile, found by probe round 18)."""
    for original, new in put_back(slots):
        same = (new.shape, new.dtype, new.device) == (original.shape, original.dtype,
                                                      original.device)  # fmt: skip
        if same and not original.is_inference():
            with torch.no_grad():
                original.copy_(new)
        else:
            for owner, name, held in slots:
                if held is original:
                    owner._buffers[name] = new


def _equal(tensor: torch.Tensor, before: torch.Tensor) -> bool:
    try:
        return bool(torch.equal(tensor, before))
    except Exception:  # a layout torch.equal does not take: taken as written
        return False


@contextmanager
def rng_restored() -> Iterator[None]:
    """Run a block, then put the RNG states back as they were before it."""
    state = capture_rng()
    try:
        yield
    finally:
        restore_rng(state)


@dataclass
class StateSnapshot:
    """RNG state and buffer values as they were before the record pass."""

    rng: RngState = field(default_factory=capture_rng)
    """RNG state at the start of the record pass."""
    buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """id -> (buffer, its value before the module first ran); a parameter the pass writes in
    place, its value before that write."""
    slots: list[BufferSlot] = field(default_factory=list)
    """(module, buffer name, buffer object) as they were before the module first ran."""
    held: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    """(module id, buffer name) -> buffer object, for the modules known before the pass
    (:meth:`hold`): what a module lent other tensors during the pass holds again after it."""
    versions: dict[int, int] = field(default_factory=dict)
    """id -> version counter of each tensor of :attr:`buffers` when its value was kept."""
    made: set[int] = field(default_factory=set)
    """Ids of the tensors torch calls of the pass made: written in place, they need no
    rewinding (they did not exist before the pass)."""
    numpy_views: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=dict)
    """id -> (tensor, its value, its version) when the pass first took ``.numpy()`` of it."""
    aliases: dict[int, torch.Tensor] = field(default_factory=dict)
    """Id of an alias that is no view (``p.data``, ``p.detach()``) a torch call of the pass
    made -> the tensor it aliases: a write to it writes that tensor."""

    def hold(self, modules: Sequence[nn.Module]) -> None:
        """Note which buffer objects ``modules`` hold before the pass (identities, no copies)."""
        for owner, name, buffer in buffer_slots(modules):
            self.held[id(owner), name] = buffer

    def add_module(self, module: nn.Module) -> None:
        """Remember the current value of every buffer of ``module`` not seen yet."""
        for slot in buffer_slots([module]):
            buffer = slot[2]
            if id(buffer) not in self.buffers:
                self._keep(buffer)
                self.slots.append(slot)

    def add_values(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Remember the current value of each of ``tensors`` not seen yet (no slot: the
        module's first call decided what it holds)."""
        for tensor in tensors:
            if tensor is not None and id(tensor) not in self.buffers:
                self._keep(tensor)

    def _keep(self, tensor: torch.Tensor) -> None:
        self.buffers[id(tensor)] = (tensor, tensor.detach().clone())
        if not tensor.is_inference():  # (an inference tensor has no version counter)
            self.versions[id(tensor)] = version(tensor)

    def lent_to_numpy(self, tensor: torch.Tensor) -> None:
        """Keep ``tensor``'s value and version before NumPy got a view of it."""
        if id(tensor) not in self.numpy_views:
            self.numpy_views[id(tensor)] = (tensor, tensor.detach().clone(), version(tensor))

    def written_unseen(self) -> bool:
        """Whether a tensor lent to NumPy changed value without a torch write (its version
        counter did not move): a write a compiled program would not repeat."""
        return any(
            version(tensor) == before_version and not torch.equal(tensor, before)
            for tensor, before, before_version in self.numpy_views.values()
        )

    def before_write(self, tensor: torch.Tensor) -> None:
        """Remember ``tensor``'s value before the record pass first writes it in place (a
        parameter, ``p.add_(...)`` under ``no_grad``; a buffer of a module the pass does not
        call; a global tensor: these are not copied unless written); it is rewound as a
        buffer is, so that the trace does not write it again."""
        self.add_values((tensor,))

    def written(self) -> list[torch.Tensor]:
        """The tensors the pass wrote or may have written: the buffers of the modules it
        called, and what it wrote in place besides."""
        return [tensor for tensor, _ in self.buffers.values()]

    def changed(self) -> list[torch.Tensor]:
        """Those of :meth:`written` the pass did write: their version counter moved, or their
        value changed (a write through ``.data`` moves no counter; a buffer replaced was put
        back with its new value). A buffer the step only reads, and a view of it held as an
        attribute (``self.head = self.b[:3]``), need no aliasing check (probe 53b)."""
        return [tensor for key, (tensor, before) in self.buffers.items()
                if self._moved(key, tensor) or not _equal(tensor, before)]  # fmt: skip

    def _moved(self, key: int, tensor: torch.Tensor) -> bool:
        return key not in self.versions or version(tensor) != self.versions[key]

    def reinstate(self) -> None:
        """Put back buffer objects the pass replaced (``self.avg = 0.9 * self.avg + ...``),
        holding the new values: compiled programs write into the original objects.
        See NOTE [side effects once]."""
        with torch.no_grad():
            for original, new in put_back(self.slots, self.held):
                original.copy_(new)

    @contextmanager
    def rewound(self) -> Iterator[None]:
        """Run a block from the state before the record pass, then restore the state after it."""
        after_rng = capture_rng()
        after = [(buf, buf.detach().clone()) for buf, _ in self.buffers.values()]
        versions = [version(buf) for buf, _ in after]
        _write(self.buffers.values())
        restore_rng(self.rng)
        try:
            yield
        finally:
            _write(after)
            restore_rng(after_rng)
            # The record pass's autograd graph saved some buffers (BatchNorm saves its running
            # stats) and checks their version counters at backward: writing them back must
            # look like no write at all, or the first call's result cannot be differentiated.
            tensors = [buf for buf, _ in after]
            set_version_counters(tuple(tensors), tuple(versions))


def _write(pairs: object) -> None:
    with torch.no_grad():
        for buffer, value in pairs:  # type: ignore[attr-defined]
            buffer.copy_(value)


def undone(modules: Sequence[nn.Module], written: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    """What a compiled call whose value guard fails must put back: the modules' buffers and
    the other tensors the record pass wrote (a global counter, a parameter)."""
    tensors = {id(b): b for m in modules for b in m.buffers()}
    tensors.update((id(t), t) for t in written)
    return tuple(tensors.values())


def module_tensors(modules: Sequence[nn.Module]) -> list[torch.Tensor]:
    """The parameters and buffers of ``modules``: inputs of a program besides its arguments."""
    return [t for m in modules for t in (*m.parameters(), *m.buffers())]
