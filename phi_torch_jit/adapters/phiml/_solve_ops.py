"""Loop capture, step 1d: a PhiML solve's body captured as a graph around its captured CG.

Run as Python around the captured solver (``_cg``), a Karman vortex street's pressure solve
spent about 80% of its time in PhiML's Python: trees, shapes, the ``SolveInfo`` and its
message, a debug f-string, its checks. While :func:`solvers_as_ops` is in effect (an engine
captures the solve's forward or backward with ``make_fx``):

* PhiML's torch backend sees a trace (``_graph_capture.seen_as_traced``): its Python takes
  the paths it takes under its own jit, reading no tensor values (no ``SolveInfo`` message; its
  convergence check deferred, ``_checks``);
* ``TorchBackend.csr_matrix`` builds its sparse matrix outside the capture (``make_fx`` cannot
  follow a CSR tensor) and remembers the captured tensors it was built from;
* each call of a captured solver becomes one op (``engines._opaque_calls``) taking those
  tensors, the right-hand side, the initial guess, the tolerance and the iteration limit. The op
  builds the matrix again from its parts at every call and runs the captured solver, as the
  Python forward did (PhiML's own loop while the solver's blocks are not compiled).

A matrix of another form (COO, a function) makes the capture fail, and the solve keeps its
Python form. The engine checks the captured graph against the recording like the Python form.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol

import torch

from ..._compat import disable_dispatch_modes
from ..._patches import RefCounted
from ...engines._opaque_calls import call, register
from ._graph_capture import seen_as_traced

__all__ = ["solvers_as_ops", "solve_as_op", "NotAnOp"]


class _Solvers(Protocol):
    """``_cg.Solvers`` as this module uses it."""

    def solve(
        self, dispatch: Any, args: tuple[Any, ...], parts: tuple[torch.Tensor, ...] | None = None
    ) -> Any: ...


class NotAnOp(RuntimeError):
    """A solve the capture cannot make one op of (its matrix is not a CSR built by PhiML)."""


_MATRICES: ContextVar[dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...], Any]] | None] = (
    ContextVar("phi_torch_jit_phiml_matrices", default=None)
)
"""While a capture runs: CSR matrices built outside it, by id, with the captured parts they
were built from and their shape."""


class _Backend:
    """``TorchBackend.csr_matrix`` building outside a capture, and ``while_loop`` refusing one
    (installed reference-counted): PhiML unrolls its ``while_loop`` to ``max_iter`` iterations
    when it sees a trace, which would compute another thing than its eager loop."""

    def __init__(self) -> None:
        self.originals: dict[str, Any] = {}

    def install(self) -> None:
        from phiml.backend.torch._torch_backend import TorchBackend

        csr = self.originals["csr_matrix"] = TorchBackend.__dict__["csr_matrix"]
        loop = self.originals["while_loop"] = TorchBackend.__dict__["while_loop"]

        def csr_matrix(self_: Any, column_indices: Any, row_pointers: Any, values: Any,
                       shape: Any) -> Any:  # fmt: skip
            matrices = _MATRICES.get()
            parts = (row_pointers, column_indices, values)
            if matrices is None or not all(isinstance(p, torch.Tensor) for p in parts):
                return csr(self_, column_indices, row_pointers, values, shape)
            with disable_dispatch_modes():
                matrix = csr(self_, column_indices, row_pointers, values, shape)
            matrices[id(matrix)] = (matrix, parts, tuple(shape))
            return matrix

        def while_loop(self_: Any, *args: Any, **kwargs: Any) -> Any:
            if _MATRICES.get() is not None:
                raise NotAnOp("it runs a PhiML while_loop, which PhiML unrolls under a trace")
            return loop(self_, *args, **kwargs)

        TorchBackend.csr_matrix = csr_matrix
        TorchBackend.while_loop = while_loop

    def remove(self) -> None:
        from phiml.backend.torch._torch_backend import TorchBackend

        for name, original in self.originals.items():
            setattr(TorchBackend, name, original)


_BACKEND = _Backend()
BACKEND_PATCHED = RefCounted(_BACKEND.install, _BACKEND.remove)


@contextmanager
def solvers_as_ops() -> Iterator[None]:
    """While the block runs on this thread, PhiML's solves are captured around one op per
    captured solver call (see the module docstring); :func:`solve_as_op` makes the op. A
    RuntimeWarning from PhiML's code meanwhile fails the capture: seeing a trace, PhiML warns
    so where it changes what it computes (a preconditioner it drops, a loop it unrolls)."""
    token = _MATRICES.set({})
    try:
        with BACKEND_PATCHED.active(), seen_as_traced():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", RuntimeWarning)
                yield
        changed = [w for w in caught if _phimls(w)]
        if changed:
            raise NotAnOp(f"PhiML warned while captured: {changed[0].message}")
    finally:
        _MATRICES.reset(token)


def _phimls(warning: warnings.WarningMessage) -> bool:
    """Whether ``warning`` is a RuntimeWarning given in PhiML's code."""
    parts = warning.filename.replace("\\", "/").split("/")
    return issubclass(warning.category, RuntimeWarning) and "phiml" in parts


def capturing_ops() -> bool:
    """Whether :func:`solvers_as_ops` is in effect on this thread."""
    return _MATRICES.get() is not None


def solve_as_op(solvers: _Solvers, dispatch: Any, args: tuple[Any, ...]) -> Any:
    """The solver ``dispatch`` (a ``_cg._Dispatch``) stands for, on ``args`` (PhiML's), as one
    op of the capture."""
    matrices = _MATRICES.get()
    lin, rest = args[0], args[1:]
    if not all(isinstance(a, torch.Tensor) for a in rest):
        raise NotAnOp("a solver argument is not a tensor")
    kept = matrices.get(id(lin)) if matrices is not None else None
    if kept is not None and kept[0] is lin:
        parts, shape = kept[1], kept[2]
    elif isinstance(lin, torch.Tensor) and lin.layout == torch.strided:
        parts, shape = (lin,), None
    else:
        raise NotAnOp("its matrix is not one PhiML built as CSR or a dense tensor")
    owner, count = weakref.ref(solvers), len(parts)  # (not the parts: the capture's tensors)

    def solve(*tensors: torch.Tensor) -> Any:
        held = owner()
        if held is None:
            raise RuntimeError("phi_torch_jit: the solvers of a captured PhiML solve are gone")
        if shape is None:
            matrix = tensors[0]
        else:  # PhiML's CSR, built again over this call's parts
            matrix = torch.sparse_csr_tensor(tensors[0], tensors[1], tensors[2], shape)
        token = _MATRICES.set(None)  # runs the solver (during the capture too: real tensors)
        try:
            parts = tuple(tensors[:count]) if shape is not None else None  # read only
            return held.solve(dispatch, (matrix, *tensors[count:]), parts)
        finally:
            _MATRICES.reset(token)

    key = register(solve, solvers, reads=count if shape is not None else 0)
    return call(key, (*parts, *rest))
