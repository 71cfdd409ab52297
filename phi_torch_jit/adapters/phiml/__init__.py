"""The PhiML / PhiFlow adapter: PhiML's values, custom gradients and solvers, plugged into the
core through :mod:`phi_torch_jit.extend` (registered when ``phi_torch_jit`` is imported;
nothing of PhiML is imported until a PhiML value, class or function is met).

==========================  ===================================================================
module                      what it does
==========================  ===================================================================
``_values``                 PhiML values in the signature: split into torch natives and a key
                            (``PhiKey``), rebuilt from new natives
``_backend_patches``        PhiML's ``while_loop`` never unrolled by a trace; its sparse matrices
                            built without TorchScript
``_checks``                 convergence checks and ``SolveTape`` records deferred out of traced
                            forwards (NOTE [SolveTape under jit])
``_graph_capture``          PhiML's custom gradients see our graph capture as a trace
``_bridge``                 ``PhiMLBridge``: our record and trace passes are PhiML's jit
                            (NOTE [PhiML bridge])
``_functions``              the forward we compile for PhiML's custom-gradient Functions
``_cg``                     PhiML's CG solvers with their loops captured as compiled blocks
``_solve_ops``              a solve's Python captured as a graph around its captured CG
``_install``                ``phi_torch_jit.phiflow.install()``: PhiML's ``jit_compile`` on us
==========================  ===================================================================
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ...extend import ClosureRoot, Library, ValueType, register_library, register_values
from ._bridge import PhiMLBridge
from ._checks import deferred_checks
from ._functions import backward_scope, closure_roots, traceable_forward
from ._pad_order import install as _fix_pad_order
from ._values import assemble, disassemble, is_phiml

__all__ = ["PHIML_VALUES", "PhiMLLibrary", "PHIML"]


PHIML_VALUES = ValueType("PhiML", is_phiml, disassemble, assemble)
"""PhiML tensors, fields, geometries and other PhiML tree nodes (``_values``)."""


def _is_phiml_code(source: Any) -> bool:
    module = getattr(source, "__module__", None) or ""
    return module == "phiml" or module.startswith("phiml.")


class PhiMLLibrary(Library):
    """PhiML's hooks (``extend.Library``)."""

    name = "PhiML"

    def pass_hooks(self) -> PhiMLBridge:
        _fix_pad_order()  # NOTE [pad order]: from the first pass on, if not at our import
        return PhiMLBridge()

    def ambient(self) -> tuple[tuple[str, Any], ...] | None:
        """PhiML's precision (``math.set_global_precision(64)``, ``with math.precision(64)``:
        its ops cast to it) and default backend (where ``math.random_normal`` draws and
        ``math.zeros`` allocate); None at 32 bits on torch or no default yet. Read from
        PhiML's own stacks (two list reads; its public getters cost twice as much)."""
        stacks = self._stacks or self._find_stacks()
        if stacks is not None:
            precision, defaults = stacks[0][-1], stacks[1]
            default = defaults[-1].name if defaults else None
        else:  # not imported yet, or a PhiML that keeps them otherwise: its public getters
            backend = sys.modules.get("phiml.backend")
            if backend is None:
                return None
            precision = backend.get_precision()
            try:
                default = backend.default_backend().name
            except IndexError:  # no backend chosen yet
                default = None
        if precision == 32 and default in (None, "torch"):
            return None
        return (("precision", precision), ("default backend", default))

    _stacks: tuple[list[int], list[Any]] | None = None

    def _find_stacks(self) -> tuple[list[int], list[Any]] | None:
        backend = sys.modules.get("phiml.backend._backend")
        precisions = getattr(backend, "_PRECISION", None)
        defaults = getattr(backend, "_DEFAULT", None)
        if not isinstance(precisions, list) or not isinstance(defaults, list):
            return None  # not imported yet (or a PhiML that keeps them otherwise)
        self._stacks = (precisions, defaults)
        return self._stacks

    def custom_forward(self, cls: type) -> Callable[..., Any] | None:
        return traceable_forward(cls)

    def backward_scope(self, cls: type) -> AbstractContextManager[Any] | None:
        return backward_scope(cls)

    def closure_roots(self, cls: type) -> tuple[ClosureRoot, ...]:
        return closure_roots(cls)

    def forward_checks(self, always: bool) -> AbstractContextManager[Any] | None:
        return deferred_checks(always) if "phiml.math._optimize" in sys.modules else None

    def owns_code(self, source: Any) -> bool:
        return _is_phiml_code(source)

    def configuration_classes(self) -> tuple[type, ...]:
        """PhiML's ``Solve``: its tolerances, iteration limit and ``x0`` are settings a user
        may change in place on a ``Solve`` kept in a global or an object."""
        solve = getattr(sys.modules.get("phiml.math._optimize"), "Solve", None)
        return (solve,) if isinstance(solve, type) else ()

    def loop_solvers(self, capture: Callable[[Callable[..., Any], str], Any]) -> Any:
        from ._cg import Solvers

        return Solvers(capture)

    def harmless_tracer_warning(self, warning: warnings.WarningMessage) -> bool:
        """PhiML turning its numpy constants into tensors: those constants are part of the
        cache key, compared by value."""
        return "registered as constants" in str(warning.message) and warning.filename.startswith(
            _phiml_dirs()
        )

    def reads_input_shape(self, warning: warnings.WarningMessage) -> bool:
        """PhiML's torch backend reading a traced tensor's shape (``TorchBackend.staticshape``)."""
        if "Converting a tensor to a Python integer" not in str(warning.message):
            return False
        backend = sys.modules.get("phiml.backend.torch._torch_backend")
        code = getattr(getattr(getattr(backend, "TorchBackend", None), "staticshape", None),
                       "__code__", None)  # fmt: skip
        if code is None or warning.filename != code.co_filename:
            return False
        lines: list[int] = [line for _, _, line in code.co_lines() if line is not None]
        return bool(min(lines) <= warning.lineno <= max(lines))


def _phiml_dirs() -> tuple[str, ...]:
    return tuple(
        os.path.dirname(module.__file__) + os.sep
        for name in ("phiml", "phi")
        if (module := sys.modules.get(name)) is not None and module.__file__
    )


_fix_pad_order()  # PhiML imported before us: one pad order for eager calls and ours alike

PHIML = PhiMLLibrary()
register_values(PHIML_VALUES)
register_library(PHIML)
