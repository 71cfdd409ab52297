"""Stage 5's check of the Python reads (:class:`PythonGuard`): before each compiled call, the
values a trace baked are fetched by one generated function and compared in three slices."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ._canonical import GUARD_NAMES
from ._records import GONE, Kind, Read, Source, Step, same_array, tensor_meta

__all__ = ["PythonGuard"]


def _fetcher(sources: list[Source]) -> Callable[[], list[Any]]:
    """A function returning the current values of ``sources`` as one list display: the
    namespaces, cells and held objects are its default arguments (fast locals), the names
    literals. A prefix that several paths share (``STAGES[250]`` under ``STAGES[250].k`` and
    ``STAGES[250].name``, the nodes of a linked list) is read once, where it is first used,
    and named (``:=``): a path costs its last step, not its depth."""
    roots: dict[int, str] = {}
    held: list[Any] = []
    chains = [_chain(source, roots, held) for source in sources]
    # how many paths each prefix starts (a whole path counts: it may be another's prefix)
    uses = Counter((root, steps[:k]) for root, steps in chains for k in range(1, len(steps) + 1))
    named: dict[tuple[str, tuple[Step, ...]], str] = {}
    items = []
    for root, steps in chains:
        code = root
        for k, step in enumerate(steps):
            prefix = (root, steps[: k + 1])
            if prefix in named:
                code = named[prefix]
                continue
            code = step.expression(code)
            if uses[prefix] > 1:  # read again by a later path: named
                named[prefix] = f"p{len(named)}"
                code = f"({named[prefix]} := {code})"
        items.append(code)
    params = [f"{name}=__held[{i}]" for i, name in enumerate(roots.values())]
    text = f"def fetch({', '.join(params)}):\n    return [{', '.join(items)}]\n"
    scope: dict[str, Any] = {"__held": held, **GUARD_NAMES}
    exec(compile(text, "<phi_torch_jit guard>", "exec"), scope)
    return scope["fetch"]  # type: ignore[no-any-return]


_CONTENTS = Step(True, "cell_contents")


def _chain(source: Source, roots: dict[int, str], held: list[Any]) -> tuple[str, tuple[Step, ...]]:
    """The parameter ``source`` starts from (one per namespace, cell or held object) and the
    steps from it: a global's name and a cell's contents are steps like the path's."""
    root: Any
    first: tuple[Step, ...]
    if source.cell is not None:
        root, first = source.cell, (_CONTENTS,)
    elif source.namespace is None:
        root, first = source.holder, ()
    else:
        root, first = source.namespace, (Step(False, source.name),)
    if id(root) not in roots:
        roots[id(root)] = f"r{len(roots)}"
        held.append(root)
    return roots[id(root)], (*first, *source.path)


_SCRIPTED = (torch.jit.ScriptFunction, torch.jit.ScriptModule)


def _opaque(value: Any) -> bool:
    """Code whose ops no torch-function mode sees: a TorchScript function or module (a
    tensor the step passes it is used unseen, and a trace would bake it)."""
    return isinstance(value, _SCRIPTED)


def _by_identity(read: Read) -> Read:
    """A tensor read no torch call was given: not an input, only the object it is (``G is
    None``, ``isinstance(G, Parameter)``, an attribute set on it, code no torch-function mode
    sees: rebinding it retraces)."""
    try:
        return replace(read, kind=Kind.IDENTITY, expected=read.source.get())
    except GONE:
        return read


def _used(read: Read, used: set[int]) -> bool:
    try:
        return id(read.source.get()) in used
    except GONE:
        return True


class PythonGuard:
    """Checks before each compiled call that the Python values a trace baked are unchanged.

    Built for speed (read before every call): the current values are fetched by one list
    comprehension over (namespace, name) and cell pairs, then compared in three slices --
    values and contents with ``==`` (and their types), objects by ``id`` (the expected objects
    are held, so their ids cannot be reused), tensors by metadata.
    """

    def __init__(self, reads: list[Read], used: set[int] | None = None) -> None:
        """``used``: ids of the tensors the program may use (``Recording.tensors_used``); a
        tensor read that is not among them is no input, guarded by identity only (unless the
        step reads TorchScript code, whose ops no torch-function mode sees: all are inputs)."""
        if used is not None and not any(_opaque(r.expected) for r in reads):
            reads = [_by_identity(r) if r.kind is Kind.TENSOR and not _used(r, used) else r
                     for r in reads]  # fmt: skip
        order = {Kind.VALUE: 0, Kind.CONTENT: 0, Kind.IDENTITY: 1, Kind.ITERATOR: 1,
                 Kind.DRAWS: 1, Kind.ARRAY: 2, Kind.TENSOR: 3}  # fmt: skip
        self.reads = tuple(sorted(reads, key=lambda r: order[r.kind]))
        """Every guarded read: values and contents, then identities, then tensors."""
        self.tensors = tuple(r for r in self.reads if r.kind is Kind.TENSOR)
        """Tensors read from globals and closures: inputs of the compiled program."""
        counts = [sum(order[r.kind] == k for r in self.reads) for k in (0, 1, 2)]
        self._n_values, self._n_ids, self._n_arrays = counts
        start = self._n_values + self._n_ids
        self._arrays = [r.expected for r in self.reads[start : start + self._n_arrays]]
        values = self.reads[: self._n_values]
        self._values = [r.expected for r in values]
        self._types = [type(r.expected) for r in values]
        self._ids = [
            id(r.expected) for r in self.reads[self._n_values : self._n_values + self._n_ids]
        ]
        self._metas = [r.expected for r in self.tensors]
        self._current = _fetcher([r.source for r in self.reads])

    def holds(self) -> bool:
        """Whether every read value is still what the trace saw."""
        try:
            now = self._current()
        except GONE:  # a global deleted, a cell emptied, an attribute or entry removed
            return False
        n, m = self._n_values, self._n_values + self._n_ids
        values = now[:n]
        if values != self._values or list(map(type, values)) != self._types:
            return False
        if list(map(id, now[n:m])) != self._ids:
            return False
        k = m + self._n_arrays
        if not all(map(same_array, now[m:k], self._arrays)):
            return False
        return list(map(tensor_meta, now[k:])) == self._metas

    def captured(self) -> list[torch.Tensor]:
        """The current values of the captured tensors, in input order."""
        return [r.source.get() for r in self.tensors]

    def describe_change(self) -> str:
        """The first read that changed, e.g. ``closure dt (read at f.py:3): 0.1 -> 0.2``."""
        for read in self.reads:
            if not read.holds():
                return read.describe()
        return "nothing"

    def __len__(self) -> int:
        return len(self.reads)
