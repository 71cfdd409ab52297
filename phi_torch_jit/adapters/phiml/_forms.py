"""Loop capture, step 1c (PhiML's CG solvers): the forms their captured product multiplies a
sparse matrix in, and the forms kept for the matrices a step passes again.

:func:`product_form` is a sparse matrix as padded rows, or as its nonzeros scattered into
their rows (``_cg._product`` multiplies either); :class:`_Forms` keeps the last few, found
again by the tensors a matrix is built over (bit for bit, or by identity where a captured
solve passes its folded constants: ``engines._folded_reads``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..._compat import storage_address, version

__all__ = ["product_form", "padded_rows", "as_csr", "Forms", "PADDED_ENTRIES", "SPARSE_LAYOUTS"]


PADDED_ENTRIES = 1 << 16
"""Padded rows up to this many entries are kept even when mostly padding: their sums round
as before (a closed box's 12x12 pressure solve, singular but for PhiML's constraint row, is
so sensitive in float32 that summing in another order made its CG diverge where eager's
converged), and their cost is small."""


def product_form(matrix: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The form :func:`_product` multiplies with: :func:`padded_rows`, unless padding would more
    than quadruple the entries of a large matrix (:data:`PADDED_ENTRIES`). One long row, such
    as the constraint on the mean that PhiML adds to a pressure matrix without a fixed
    boundary value, padded every row of a 32x32 grid's matrix to 1024 entries: a product 150x
    the sparse one's work, 13 ms per block of four CG iterations. Then the nonzeros scattered
    into their rows, ``(rows, columns, values)``: ``index_add`` of ``values * b[columns]`` at
    ``rows`` (the same terms, summed in another order)."""
    columns, values = padded_rows(matrix)
    nonzeros = int(torch.count_nonzero(values)) if values.numel() else 0
    if values.numel() <= max(4 * nonzeros, PADDED_ENTRIES):
        return columns, values
    csr = as_csr(matrix)
    crow = csr.crow_indices()
    rows = torch.repeat_interleave(torch.arange(crow.numel() - 1, device=crow.device), crow.diff())
    return rows, csr.col_indices().long(), csr.values()


def padded_rows(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse matrix as ``(columns, values)``, each ``[rows, width]``: row ``i``'s nonzeros
    in their order, padded with column 0 and value 0 up to the longest row's ``width``. Then
    ``matrix @ b`` is ``(values * b[columns]).sum(-1)``: the same terms as the sparse
    product (their sum may round differently in the last bit)."""
    matrix = as_csr(matrix)
    if matrix.layout != torch.sparse_csr or matrix.dim() != 2:
        raise ValueError(f"a 2D sparse CSR, CSC or COO matrix is needed, not {matrix.layout}")
    crow, col, val = matrix.crow_indices(), matrix.col_indices(), matrix.values()
    counts = crow[1:] - crow[:-1]
    rows = counts.numel()
    width = int(counts.max()) if rows else 0  # one host read per solve
    row_of = torch.repeat_interleave(torch.arange(rows, device=col.device), counts)
    slot = torch.arange(col.numel(), device=col.device) - crow[:-1][row_of]
    columns = torch.zeros((rows, width), dtype=torch.long, device=col.device)
    values = torch.zeros((rows, width), dtype=val.dtype, device=val.device)
    columns[row_of, slot] = col.long()
    values[row_of, slot] = val
    return columns, values


SPARSE_LAYOUTS = (torch.sparse_csr, torch.sparse_csc, torch.sparse_coo)
"""The sparse layouts the captured solvers multiply with. PhiML's adjoint solve (in the
backward of a solve) gets the transposed CSR matrix: a CSC one."""


def as_csr(matrix: torch.Tensor) -> torch.Tensor:
    """``matrix`` in CSR layout (the same entries; COO is coalesced first)."""
    if matrix.layout == torch.sparse_coo:
        return matrix.coalesce().to_sparse_csr()
    if matrix.layout == torch.sparse_csc:
        return matrix.to_sparse_csr()
    return matrix


class Forms:
    """:func:`product_form` of the last few sparse matrices. A PhiFlow step passes the same
    matrix to every call's solve (a new sparse tensor over equal index and value tensors), and
    building its padded rows anew took 1.06 ms of a 7.4 ms heat step.

    A matrix is found by its entries: its layout and shape, and its index and value tensors
    equal bit for bit to a copy kept of them (0.1 ms for a 128x128 grid's matrix). Version
    counters cannot tell: a sparse tensor made over a written value tensor starts its own at
    zero. A matrix whose values require grad, or whose parts are not plain tensors with memory
    (fake tensors of a trace), is never kept."""

    KEPT = 4

    def __init__(self) -> None:
        self._entries: list[_Form] = []
        self._lock = threading.Lock()

    def form_of(
        self, matrix: torch.Tensor, parts: tuple[torch.Tensor, ...] | None = None
    ) -> tuple[torch.Tensor, ...]:
        """``matrix``'s form; ``parts``: the tensors it was built over, as the caller holds
        them (a captured solve's folded constants, ``engines._folded_reads``): the same
        objects at the same versions as a kept form's are that matrix, without comparing
        their bits."""
        if parts is not None:
            found = self._first(lambda entry: entry.built_over(matrix, parts))
            if found is not None:
                return found.form
        described = _described(matrix)
        if described is None:
            return product_form(matrix)
        header, bits = described
        found = self._first(lambda entry: entry.matches(header, bits))
        if found is not None:
            found.known_by(parts)
            return found.form
        form = product_form(matrix)
        with self._lock:
            entry = _Form(header, tuple(b.clone() for b in bits), form)
            entry.known_by(parts)
            self._entries.insert(0, entry)
            del self._entries[self.KEPT :]
        return form

    def _first(self, test: Callable[[_Form], bool]) -> _Form | None:
        """The most recent kept form that passes ``test``, moved to the front; None."""
        with self._lock:
            for i, entry in enumerate(self._entries):
                if test(entry):
                    self._entries.insert(0, self._entries.pop(i))
                    return entry
        return None


class _Form:
    """A kept :func:`product_form`: the matrix it was built from, and the form with its
    tensors' versions (ours: a write to one is seen)."""

    def __init__(
        self,
        header: tuple[Any, ...],
        bits: tuple[torch.Tensor, ...],
        form: tuple[torch.Tensor, ...],
    ) -> None:
        self.header, self.bits, self.form = header, bits, form
        self.versions = tuple(version(t) for t in form)
        self.parts: tuple[weakref.ref[torch.Tensor], ...] = ()
        """The tensors a matrix equal to this one was last built over (weakly: the form does
        not keep them alive), and their versions and shapes then."""
        self.marks: tuple[Any, ...] = ()

    def matches(self, header: tuple[Any, ...], bits: tuple[torch.Tensor, ...]) -> bool:
        return (
            header == self.header
            and all(torch.equal(a, b) for a, b in zip(bits, self.bits))
            and self._form_unwritten()
        )

    def _form_unwritten(self) -> bool:
        return tuple(version(t) for t in self.form) == self.versions

    def known_by(self, parts: tuple[torch.Tensor, ...] | None) -> None:
        """Remember ``parts`` (those of a matrix that matched) for :meth:`built_over`."""
        marks = _marks(parts) if parts is not None else None
        known = () if parts is None or marks is None else tuple(weakref.ref(p) for p in parts)
        self.parts, self.marks = known, marks or ()

    def built_over(self, matrix: torch.Tensor, parts: tuple[torch.Tensor, ...]) -> bool:
        """Whether ``matrix`` is built over the very tensors a matching one was, unwritten
        since (the same objects alive, at the same versions and shapes), and the form too."""
        if not self.parts or len(parts) != len(self.parts):
            return False
        if any(ref() is not part for ref, part in zip(self.parts, parts)):
            return False
        return (
            _marks(parts) == self.marks
            and (matrix.layout, tuple(matrix.shape)) == self.header[:2]
            and self._form_unwritten()
        )


def _marks(parts: tuple[torch.Tensor, ...]) -> tuple[Any, ...] | None:
    """The versions and shapes of ``parts``; None where one has no version counter (made in
    inference mode)."""
    try:
        return tuple((version(p), tuple(p.shape), p.stride(), p.storage_offset()) for p in parts)
    except RuntimeError:
        return None


_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}
"""An integer type to compare a part's bytes as (as bytes: 7x slower)."""


def _described(matrix: torch.Tensor) -> tuple[tuple[Any, ...], tuple[torch.Tensor, ...]] | None:
    """``matrix``'s layout, shape and parts' dtypes, and its parts' bits as integers (``-0.0``
    and ``0.0`` differ, a NaN equals itself); None: not to be kept."""
    parts: tuple[torch.Tensor, ...]
    if matrix.layout == torch.sparse_coo:  # coalesced (else not kept): its own parts
        parts = (matrix.indices(), matrix.values()) if matrix.is_coalesced() else ()
    elif matrix.layout == torch.sparse_csc:
        parts = (matrix.ccol_indices(), matrix.row_indices(), matrix.values())
    else:
        parts = (matrix.crow_indices(), matrix.col_indices(), matrix.values())
    if not parts or matrix.requires_grad:
        return None
    header: list[Any] = [matrix.layout, tuple(matrix.shape), matrix.device]
    bits = []
    for t in parts:
        if type(t) is not torch.Tensor or t.requires_grad or storage_address(t) is None:
            return None
        header += (t.dtype, tuple(t.shape))
        bits.append(t.reshape(-1).contiguous().view(_SAME_WIDTH[t.element_size()]))
    return tuple(header), tuple(bits)
