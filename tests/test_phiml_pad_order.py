"""PhiML pads mixed boundaries in one order in every process (adapters/phiml/_pad_order.py,
NOTE [pad order]): the captured graph of a grid with mixed boundaries no longer depends on
where its extrapolation classes lie in memory, so a second process finds it in inductor's
caches.

A process's addresses are simulated by hashing PhiML's constant extrapolations two ways: a
set of two of them then iterates in one order or in the other, as it does from one process
to the next.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from helpers import program_of

pytest.importorskip("phiml")
pytest.importorskip("phi")

from phi.torch.flow import ZERO_GRADIENT, CenteredGrid, diffuse, extrapolation, math
from phiml.math import extrapolation as phiml_extrapolation

import phi_torch_jit as ptj
from phi_torch_jit.adapters.phiml import _pad_order

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),  # PhiML: sparse CSR beta, from_numpy
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # PhiFlow calling PhiML
]

_Constant = phiml_extrapolation.ConstantExtrapolation


def _hashed(upward: bool) -> Callable[[Any], int]:
    """A hash of constant extrapolations consistent with their ``==``: 1 for the zero
    constant, 2 for the others, or the reverse (the zero gradient hashes as 3:
    :func:`_fixed_hashes`, so that no address collides with them)."""

    def hash_(self: Any) -> int:
        zero = bool(math.all(self.value == 0))
        return (1 if zero else 2) if upward else (2 if zero else 1)

    return hash_


def _fixed_hashes(monkeypatch: pytest.MonkeyPatch, upward: bool) -> None:
    """Hashes that give a set of the three extrapolations one order or the other, whatever
    the addresses of their classes (the zero gradient's hash is its class's address: it could
    take a constant's slot, and both orders were then the same in one run of the suite)."""
    monkeypatch.setattr(_Constant, "__hash__", _hashed(upward))
    monkeypatch.setattr(type(ZERO_GRADIENT), "__hash__", lambda self: 3)


@pytest.fixture
def pads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """The extrapolations that pad, in the order they do (each constant's value, or its
    class's name)."""
    order: list[Any] = []
    for cls in (_Constant, type(ZERO_GRADIENT)):
        original = cls.pad

        def pad(self: Any, value: Any, *args: Any, _original: Any = original, **kw: Any) -> Any:
            if any(w != (0, 0) for w in args[0].values()):
                order.append(
                    float(self.value) if isinstance(self, _Constant) else type(self).__name__
                )
            return _original(self, value, *args, **kw)

        monkeypatch.setattr(cls, "pad", pad)
    yield order


def _boundary() -> Any:
    """A fixed value on the left, an open outflow on the right, zero above and below: two
    constants of one pad rank and a zero gradient (as in PhiFlow's pipe)."""
    return extrapolation.combine_sides(x=(1, ZERO_GRADIENT), y=0)


def _pad_orders(monkeypatch: pytest.MonkeyPatch, pads: list[Any]) -> list[list[Any]]:
    values = math.random_normal(math.spatial(x=6, y=4))
    orders = []
    for upward in (True, False):
        _fixed_hashes(monkeypatch, upward)
        pads.clear()
        math.pad(values, {"x": (1, 1), "y": (1, 1)}, _boundary())
        orders.append(list(pads))
    return orders


def test_phimls_own_pad_order_follows_the_hashes(
    monkeypatch: pytest.MonkeyPatch, pads: list[Any]
) -> None:
    """The premise: PhiML's method pads the two constants in the order their hashes give."""
    if _pad_order.installed():
        monkeypatch.setattr(
            phiml_extrapolation._MixedExtrapolation, "pad", _pad_order._STATE["original"]
        )
    first, second = _pad_orders(monkeypatch, pads)
    assert first != second and sorted(map(str, first)) == sorted(map(str, second))


def test_mixed_boundaries_pad_in_the_order_their_faces_name_them(
    monkeypatch: pytest.MonkeyPatch, pads: list[Any]
) -> None:
    assert _pad_order.install() and _pad_order.installed()
    first, second = _pad_orders(monkeypatch, pads)
    assert first == second
    # the outflow first (its rank), then the constants as the faces name them: x- before y
    assert list(dict.fromkeys(first)) == ["_ZeroGradient", 1.0, 0.0]


def test_the_order_is_one_phimls_own_method_may_take(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both orders PhiML may take give what ours gives where ours is one of them."""
    assert _pad_order.install()
    values = math.random_normal(math.spatial(x=6, y=4))
    ours = math.pad(values, {"x": (1, 1), "y": (1, 1)}, _boundary())
    original = _pad_order._STATE["original"]
    monkeypatch.setattr(phiml_extrapolation._MixedExtrapolation, "pad", original)
    results = []
    for upward in (True, False):
        _fixed_hashes(monkeypatch, upward)
        results.append(math.pad(values, {"x": (1, 1), "y": (1, 1)}, _boundary()))
    assert any(math.always_close(ours, r, rel_tolerance=0, abs_tolerance=0) for r in results)


def _pipe_like(v: Any) -> Any:
    return diffuse.explicit(v, 0.1, 1.0)


def _captured_code(upward: bool, monkeypatch: pytest.MonkeyPatch) -> str:
    _fixed_hashes(monkeypatch, upward)
    v = CenteredGrid(math.random_normal(math.spatial(x=8, y=6)), _boundary())
    jitted = ptj.jit(_pipe_like, engine="auto", backend="eager")
    out = jitted(v)
    assert math.always_close(out.values, _pipe_like(v).values, rel_tolerance=1e-6)
    code = program_of(jitted).target.graph.code
    jitted.clear_cache()
    return str(code)


def test_a_grid_with_mixed_boundaries_is_captured_alike_whatever_the_hashes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two processes (two hashes of the constants) capture one graph: inductor's caches and
    our fingerprints find the first process's program in the second."""
    assert _pad_order.install()
    assert _captured_code(True, monkeypatch) == _captured_code(False, monkeypatch)
