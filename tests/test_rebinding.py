"""Stage 3 (wrapper), ``_rebinding``: a tensor the step reads from Python state is an input of
the compiled program; while the wrapper is traced, the place the read *found* it holds the
traced input, and afterwards exactly what it held (probe round 36a). Before, the input was set
on the object the read went through: a class attribute read as ``self.W`` stayed in the
instance's ``__dict__`` for good (a later ``Scale.W = ...`` was seen by nobody, eager code
included), a ``ChainMap`` gained an entry in its first map, and a ``__setattr__`` or
``__setitem__`` of yours ran twice per trace or refused the write. Every engine."""

from __future__ import annotations

import collections
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines

X = torch.arange(1.0, 5.0)


def _like_eager(jitted: Any, step: Callable[[torch.Tensor], torch.Tensor]) -> None:
    for _ in range(3):
        torch.testing.assert_close(jitted(X), step(X))
    jitted.wait_compiled()
    torch.testing.assert_close(jitted(X), step(X))


def _compiled_like_eager(
    step: Callable[[torch.Tensor], torch.Tensor], changes: list[Callable[[], None]]
) -> Any:
    """Calls like eager, no JitWarning (the step compiles), then after each change."""
    jitted = ptj.jit(step)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        _like_eager(jitted, step)
        for change in changes:
            change()
            _like_eager(jitted, step)
    return jitted


class _Scale:
    W = torch.full((4,), 2.0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.W


class _Sub(_Scale):
    def through_super(self, x: torch.Tensor) -> torch.Tensor:
        return x * super().W + type(self).W


@pytest.mark.parametrize("read", ["self.W", "base class via subclass", "super and type(self)"])
def test_a_class_attribute_read_through_an_instance_stays_the_classs(read: str) -> None:
    _Scale.W = torch.full((4,), 2.0)
    op: Any = _Scale() if read == "self.W" else _Sub()
    if read == "super and type(self)":
        step: Callable[[torch.Tensor], torch.Tensor] = lambda x: op.through_super(x)  # noqa: E731
    else:
        step = lambda x: op(x)  # noqa: E731

    def rebind() -> None:
        _Scale.W = torch.zeros(4)

    def in_place() -> None:
        _Scale.W.add_(3.0)

    _compiled_like_eager(step, [rebind, in_place])
    assert "W" not in vars(op) and "W" not in vars(_Sub)


def test_a_chainmaps_entry_is_rebound_in_the_map_that_holds_it() -> None:
    low = {"w": torch.full((4,), 2.0)}
    chain: collections.ChainMap[str, torch.Tensor] = collections.ChainMap({}, low)
    ops = [lambda x: x * chain["w"]]

    def rebind() -> None:
        low["w"] = torch.zeros(4)

    _compiled_like_eager(lambda x: ops[0](x), [rebind])
    assert not chain.maps[0]


def test_your_setitem_and_setattr_do_not_run_and_cannot_refuse() -> None:
    class Audited(dict[str, torch.Tensor]):
        writes = 0

        def __setitem__(self, key: str, value: torch.Tensor) -> None:
            type(self).writes += 1
            super().__setitem__(key, value)

    class Frozen:
        def __init__(self) -> None:
            object.__setattr__(self, "w", torch.full((4,), 2.0))
            object.__setattr__(self, "frozen", True)

        def __setattr__(self, key: str, value: Any) -> None:
            if not self.frozen:  # a config that ignores writes once built
                object.__setattr__(self, key, value)

    table = Audited(w=torch.full((4,), 3.0))
    Audited.writes = 0
    cfg = Frozen()

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * table["w"] + cfg.w

    def rebind() -> None:
        object.__setattr__(cfg, "w", torch.zeros(4))

    _compiled_like_eager(step, [rebind])
    assert Audited.writes == 0


def test_tensors_in_slots_and_frozen_dataclasses_compile_and_follow_their_changes() -> None:
    class Slotted:
        __slots__ = ("w",)

        def __init__(self) -> None:
            self.w = torch.full((4,), 2.0)

    @dataclasses.dataclass(frozen=True)
    class Params:
        w: torch.Tensor

    slotted, params = Slotted(), Params(torch.full((4,), 5.0))

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * slotted.w - params.w

    def rebind_slot() -> None:
        slotted.w = torch.ones(4)

    def in_place() -> None:
        params.w.mul_(2.0)

    _compiled_like_eager(step, [rebind_slot, in_place])


def test_a_tensor_that_a_getattr_computes_runs_eagerly_and_leaves_no_attribute() -> None:
    class Computed:
        base = torch.full((4,), 2.0)

        def __getattr__(self, name: str) -> torch.Tensor:
            if name == "w":
                return self.base * 2.0
            raise AttributeError(name)

    cfg = Computed()
    step = lambda x: x * cfg.w  # noqa: E731
    jitted = ptj.jit(step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ptj.JitWarning)
        _like_eager(jitted, step)
        Computed.base = torch.ones(4)
        _like_eager(jitted, step)
    assert "w" not in vars(cfg)


def test_a_slot_beside_a_same_named_dict_entry_is_rebound_as_python_reads_it() -> None:
    """A base class's slot and a subclass without ``__slots__``: an entry ``"w"`` in the
    instance's ``__dict__`` is ignored by Python (the slot, a data descriptor, wins) but took
    the traced input, so the program kept the slot's tensor as a constant (probe 37e)."""

    class Slotted:
        __slots__ = ("w",)

    class Open(Slotted):
        pass

    held = Open()
    held.w = torch.full((4,), 2.0)
    held.__dict__["w"] = torch.full((4,), 99.0)

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * held.w

    def rebind() -> None:
        held.w = torch.full((4,), 3.0)

    def in_place() -> None:
        held.w.add_(1.0)

    _compiled_like_eager(step, [rebind, in_place])
    assert held.__dict__["w"][0] == 99.0
