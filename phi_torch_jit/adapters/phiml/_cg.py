"""Loop capture, step 1c: PhiML's conjugate-gradient solvers.

``solve_linear`` with ``'CG'`` or ``'CG-adaptive'`` on PhiML's torch backend runs its loop in
the module-level functions ``torch_sparse_cg`` and ``torch_sparse_cg_adaptive`` of
``phiml.backend.torch._torch_backend``, reached through the backend object's methods, where
:mod:`._callees` does not follow. Their loops are capturable as written (a ``while`` on
``~torch.all(finished)``, an ``if`` on the iteration count, in-place counters), but their
matrix is a sparse CSR tensor, whose product ``make_fx`` cannot trace.

So each solver is captured from PhiML's own source, with its product (the global
``sparse_matmul``, rebound in a copy of the function's globals) computed on the matrix in
*padded rows*: per row, the columns and values of its nonzeros, padded with zeros to the
longest row (five for a 2D Laplacian). The product is a gather, a multiply and a sum over
the row, which inductor fuses into the iteration's kernels. A matrix with a long row (PhiML's
constraint on the mean) is multiplied as its nonzeros scattered into their rows instead
(:func:`product_form`). A dense matrix keeps PhiML's product.

While :meth:`Solvers.active` is in effect, PhiML's two functions (replaced once, at the first
use, by a :class:`_Dispatch` that otherwise calls PhiML's function unchanged, under a trace
too) call the captured solvers. Engines use this for the custom functions of PhiML's solves
(:mod:`phi_torch_jit.engines._looped`), and check the result against the recording as for any
captured loop. If PhiML's functions are not the ones this was written for, nothing is
replaced.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from typing import Any, cast

import torch

from ..._compat import get_tracing_state
from ._forms import SPARSE_LAYOUTS, Forms, padded_rows, product_form
from ._solve_ops import capturing_ops, solve_as_op, solvers_as_ops

__all__ = ["Solvers", "SOLVERS", "padded_rows", "product_form"]

SOLVERS = ("torch_sparse_cg", "torch_sparse_cg_adaptive")
"""PhiML's loops that are captured, by their names in its torch backend."""
_MODULE = "phiml.backend.torch._torch_backend"
_PARAMETERS = ("lin", "y", "x0", "tolerance_sq", "max_iter")
"""The signature they were written with (phiml 1.x)."""

_ACTIVE: ContextVar[Solvers | None] = ContextVar("phi_torch_jit_phiml_solvers", default=None)
_CHECKING: ContextVar[bool] = ContextVar("phi_torch_jit_phiml_checking", default=False)
"""Set in the first call of :meth:`Solvers.calling`'s function: the engine's check of the
captured solvers against the recording, which must run them."""
_INSTALL_LOCK = threading.Lock()


_OUTSIDE_BLOCKS: ContextVar[tuple[Any, torch.Tensor] | None] = ContextVar(
    "phi_torch_jit_phiml_csr", default=None
)
"""``(form, csr)`` while a captured solver runs on ``form``, built from the CSR ``csr``."""


def _product(matrix: Any, b: torch.Tensor) -> torch.Tensor:
    """PhiML's ``sparse_matmul(matrix, b)`` (``b``: ``[batch, n]``) for padded rows or a dense
    matrix. Outside the blocks (the solver's first residual, before its loop) a single
    right-hand side is multiplied with the CSR matrix the form was built from, as PhiML does
    (``torch.mv``: 54 us against the padded rows' 145 us for a 128x128 grid's matrix); blocks
    are traced on copies of the form, never this tuple, and keep the padded rows."""
    outside = _OUTSIDE_BLOCKS.get()
    if outside is not None and outside[0] is matrix and b.dim() == 2 and b.shape[0] == 1:
        csr = outside[1]
        if type(b) is torch.Tensor and b.dtype == csr.dtype and b.device == csr.device:
            return torch.mv(csr, b[0]).unsqueeze(0)
    if type(matrix) is tuple and len(matrix) == 3:  # scattered nonzeros (product_form)
        rows, columns, values = matrix
        scattered: torch.Tensor = torch.zeros_like(b).index_add_(1, rows, values * b[:, columns])
        return scattered
    if type(matrix) is tuple:
        columns, values = matrix
        product: torch.Tensor = (values * b[:, columns]).sum(-1)
        return product
    return torch.matmul(matrix, b.transpose(0, 1)).transpose(0, 1)


class _Dispatch:
    """Stands for one of PhiML's solver functions in its module: the captured solver while
    :meth:`Solvers.active` is in effect, PhiML's function otherwise (under a TorchScript trace
    too, where PhiML scripts its loop)."""

    def __init__(self, name: str, original: Callable[..., Any]) -> None:
        self.name = name
        self.original = original
        self.__wrapped__ = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        solvers = _ACTIVE.get()
        tracing = get_tracing_state() is not None  # PhiML scripts its loop then
        if solvers is None or kwargs or len(args) != len(_PARAMETERS) or tracing:
            return self.original(*args, **kwargs)
        return solvers.solve(self, args)


_DISPATCHERS: dict[str, _Dispatch] = {}


def _installed() -> dict[str, _Dispatch] | None:
    """PhiML's solvers replaced by dispatchers (once); None where PhiML or its solvers are not
    the ones this module knows."""
    if _DISPATCHERS:
        return _DISPATCHERS
    module = sys.modules.get(_MODULE)
    if module is None:
        return None
    with _INSTALL_LOCK:
        found: dict[str, _Dispatch] = {}
        for name in SOLVERS:
            current = getattr(module, name, None)
            if isinstance(current, _Dispatch):
                found[name] = current
                continue
            source = getattr(current, "__original_fn", current)
            code = getattr(source, "__code__", None)
            if code is None or code.co_varnames[: code.co_argcount] != _PARAMETERS:
                return None
            found[name] = _Dispatch(name, current)  # type: ignore[arg-type]
        for name, dispatch in found.items():
            setattr(module, name, dispatch)
        _DISPATCHERS.update(found)
        _quiet_print_check()
        return _DISPATCHERS


def _quiet_print_check() -> None:
    """PhiML's ``check_is_printing`` answers False while captured solvers are active.

    PhiML's linear solve logs ``f"Performing linear solve {solve} ..."`` at debug level: the
    f-string is built with logging off too, and formatting the solve's tolerance asks
    ``check_is_printing`` whether to use colors, which walks the whole stack
    (``traceback.extract_stack``, reading every frame's source line): 1.3-1.5 ms of a heat
    step's 7.4 ms. False is its answer wherever no ``print(`` line is on the stack, and only
    chooses plain text over terminal colors. Nothing is replaced where PhiML has no such
    function of no arguments."""
    module = sys.modules.get("phiml.math._tensors")
    check = getattr(module, "check_is_printing", None)
    code = getattr(check, "__code__", None)
    if code is None or code.co_argcount or getattr(check, "__wrapped__", None) is not None:
        return
    assert check is not None

    def check_is_printing() -> bool:
        return _ACTIVE.get() is None and bool(check())

    check_is_printing.__wrapped__ = check  # type: ignore[attr-defined]
    module.check_is_printing = check_is_printing  # type: ignore[union-attr]


def _with_product(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with its global ``sparse_matmul`` rebound to :func:`_product` (a copy of its
    globals: PhiML's module is untouched)."""
    scope = dict(fn.__globals__)
    scope["sparse_matmul"] = _product
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__qualname__ = fn.__qualname__
    copy.__module__ = fn.__module__
    return copy


def _uncompiled(captured: Any) -> bool:
    """Whether the captured solver's blocks still run straight-line while the backend compiles
    them (engine auto): uncompiled, a padded-row product and predicated iterations took 12.7 ms
    for 13 iterations at 128x128, PhiML's own loop (its sparse product, stopping when
    converged) 4.1 ms, and compiled blocks about 1.5 ms. A solver whose blocks are not built
    yet runs captured, which builds them, and so does an engine's check (``_CHECKING``)."""
    return any(loop.runs_straight_line() for loop in captured.loops)


class Solvers:
    """PhiML's solvers with their loops captured, for one engine (its backend compiles the
    blocks); :meth:`active` makes PhiML call them."""

    def __init__(self, capture: Callable[[types.FunctionType, str], Any]) -> None:
        """``capture(fn, label)``: the engine's :func:`~phi_torch_jit._loops.capture_loops`
        of ``fn`` (a ``Captured``, or why not as a sentence)."""
        self._capture = capture
        self._captured: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.runs = 0
        """Solves run by a captured solver (for the engine's check that one ran, and tests)."""
        self._forms = Forms()

    def captured(self, name: str) -> Any:
        """The ``Captured`` of PhiML's solver ``name``, or why it is not (a sentence)."""
        with self._lock:
            if name not in self._captured:
                self._captured[name] = self._make(name)
            return self._captured[name]

    def _make(self, name: str) -> Any:
        dispatchers = _installed()
        if dispatchers is None:
            return "PhiML's CG functions are not the ones phi_torch_jit knows"
        source = getattr(dispatchers[name].original, "__original_fn", None)
        if not isinstance(source, types.FunctionType):
            return "PhiML's CG function is not a Python function"
        return self._capture(_with_product(source), f"PhiML's {name}")

    def solve(
        self,
        dispatch: _Dispatch,
        args: tuple[Any, ...],
        parts: tuple[torch.Tensor, ...] | None = None,
    ) -> Any:
        """PhiML's solver ``dispatch`` stands for, on ``args``: captured, or PhiML's own for
        what the captured one does not take (another matrix layout). ``parts``: the tensors
        a sparse matrix was built over (``_forms.Forms.form_of``)."""
        captured = self.captured(dispatch.name)
        if capturing_ops() and not isinstance(captured, str):
            return solve_as_op(self, dispatch, args)
        lin = args[0]
        if isinstance(captured, str) or not isinstance(lin, torch.Tensor):
            return dispatch.original(*args)
        if not _CHECKING.get() and _uncompiled(captured):
            return dispatch.original(*args)
        csr = lin if lin.layout == torch.sparse_csr else None
        if lin.layout in SPARSE_LAYOUTS:
            lin = self._forms.form_of(lin, parts)
        elif lin.layout != torch.strided:
            return dispatch.original(*args)
        self.runs += 1
        token = _OUTSIDE_BLOCKS.set(None if csr is None else (lin, csr))
        try:
            return captured.function(lin, *args[1:])
        finally:
            _OUTSIDE_BLOCKS.reset(token)

    def loops(self) -> tuple[Any, ...]:
        """The captured loops made so far (for ``eager_reasons`` and ``explain()``)."""
        with self._lock:
            made = list(self._captured.values())
        return tuple(loop for c in made if not isinstance(c, str) for loop in c.loops)

    def calling(self, fn: Callable[..., Any]) -> types.FunctionType:
        """``fn`` run with PhiML's CG calls going to the captured solvers. Its first call, the
        engine's check against the recording, runs them whatever tier their blocks are on
        (the solvers are shared by an engine's solves: the blocks the forward built and left
        straight-line made a backward's check run PhiML's loop, and the check then refused
        the backward, which ran as PhiML's Python CG: a gradient step 2x slower)."""
        checked = False

        def with_captured_solvers(*args: Any, **kwargs: Any) -> Any:
            nonlocal checked
            checking = _CHECKING.set(not checked)
            checked = True
            try:
                with self.active():
                    return fn(*args, **kwargs)
            finally:
                _CHECKING.reset(checking)

        return cast(types.FunctionType, with_captured_solvers)

    def describe(self) -> str:
        """For ``explain()``: which of PhiML's solvers are captured."""
        with self._lock:
            made = [name for name, c in self._captured.items() if not isinstance(c, str)]
        names = ", ".join(f"PhiML's {name}" for name in made) or "PhiML's CG"
        return (
            f"loop of {names} captured as blocks of predicated iterations; PhiML's own loop "
            "while they are not compiled"
        )

    def as_ops(self) -> AbstractContextManager[None]:
        """While in effect on this thread, a solve captured with ``make_fx`` records each call of
        a captured solver as one op (``_solve_ops``)."""
        return solvers_as_ops()

    @contextmanager
    def active(self) -> Iterator[None]:
        """PhiML's CG calls in this thread run the captured solvers."""
        _installed()
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)
