"""PhiML pads a grid with mixed boundaries in one order in every process (NOTE [pad order]).

PhiML's ``_MixedExtrapolation.pad`` pads once per distinct extrapolation of a grid's faces
(``combine_sides(x=(inflow, ZERO_GRADIENT), y=0)``: the constants, then the zero gradient),
ordered by their pad rank. It finds them as a ``set``, and several extrapolations hash as
their class does, that is by its address in memory: where two share a rank, the order in
which they pad changes from one process to the next, even with ``PYTHONHASHSEED`` fixed. The
graph we capture then differs between processes (PhiFlow's pipe: the two constant pads
swapped, their ``permute``s and ``view``s after them), so inductor's caches never hold it and
a warm start compiles as a cold one.

:func:`install` replaces that method with one that pads the same extrapolations in the order
the grid's faces first name them, sorted by rank as PhiML sorts them: one of the orders PhiML
itself may take, the same in every process. It is installed once, for good, when phi_torch_jit
first meets PhiML (``import phi_torch_jit`` with PhiML imported, or the first pass of a
jitted function), so that eager calls and compiled ones pad alike from then on. A PhiML whose
method is not the one described (another version) is left as it is.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

__all__ = ["install", "installed", "uninstall", "faces_order"]

_logger = logging.getLogger("phi_torch_jit")
_STATE: dict[str, Any] = {"original": None, "checked": False}


def faces_order(mixed: Any) -> list[Any]:
    """The distinct extrapolations of ``mixed`` (a ``_MixedExtrapolation``), in the order its
    faces first name them, sorted by pad rank (a stable sort: equal ranks keep that order)."""
    distinct: list[Any] = []
    for extrapolation in mixed.ext.values():
        if extrapolation not in distinct:  # by ==, as PhiML's set tells them apart
            distinct.append(extrapolation)
    distinct.sort(key=lambda extrapolation: extrapolation.pad_rank)
    return distinct


def _pad(
    self: Any, value: Any, widths: dict[str, Any], already_padded: Any = None, **kwargs: Any
) -> Any:
    """``_MixedExtrapolation.pad``, each extrapolation padding its own faces, in
    :func:`faces_order`."""
    done = {} if already_padded is None else dict(already_padded)
    for extrapolation in faces_order(self):
        own = {
            dim: (
                lower if self._at_boundary(dim + "-") == extrapolation else 0,
                upper if self._at_boundary(dim + "+") == extrapolation else 0,
            )
            for dim, (lower, upper) in widths.items()
        }
        value = extrapolation.pad(value, own, already_padded=done, **kwargs)
        done.update(own)
    return value


def _known(method: Any) -> bool:
    """Whether ``method`` is the PhiML method this module describes: it finds the
    extrapolations as a set, sorts them by pad rank and pads with each."""
    code = getattr(method, "__code__", None)
    names: set[str] = set()
    codes = [code] if code is not None else []
    while codes:  # with its lambdas' and comprehensions' code
        each = codes.pop()
        names.update(each.co_names)
        codes.extend(const for const in each.co_consts if hasattr(const, "co_names"))
    return {"set", "sorted", "pad_rank", "_at_boundary", "pad"} <= names


def install() -> bool:
    """Pad mixed boundaries in one order from now on (idempotent); whether it is in effect.
    Nothing happens while PhiML is not imported."""
    if _STATE["original"] is not None:
        return True
    module = sys.modules.get("phiml.math.extrapolation")
    mixed = getattr(module, "_MixedExtrapolation", None)
    if mixed is None:
        return False
    method = mixed.__dict__.get("pad")
    if not _known(method):
        if not _STATE["checked"]:
            _STATE["checked"] = True
            _logger.debug(
                "phi_torch_jit: PhiML's mixed-boundary pad is not the one known: its order "
                "is left as it is (warm starts of such grids may compile anew)"
            )
        return False
    _STATE["original"] = method
    mixed.pad = _pad
    return True


def installed() -> bool:
    """Whether PhiML's mixed-boundary pad runs in :func:`faces_order` (tests)."""
    return _STATE["original"] is not None


def uninstall() -> None:
    """Give PhiML its own method back (tests)."""
    original = _STATE["original"]
    if original is None:
        return
    module = sys.modules["phiml.math.extrapolation"]
    module._MixedExtrapolation.pad = original
    _STATE["original"] = None
