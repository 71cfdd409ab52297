"""Stage 1 (reads), ``_reads/_module_attributes``: what the modules a call ran hold beyond the
module guard's immutable attributes (probe round 35): mutable attributes of their parameters and
buffers, the slots of a module class of yours, and a number of a subclass of yours that holds
attributes. Each change retraces or runs eagerly warned, never a stale value. Every engine."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines


def test_a_list_set_on_a_parameter_and_changed_in_place_retraces() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(4, 4)
    linear.weight.schedule = [1.0, 2.0]  # type: ignore[attr-defined]

    def step(x: torch.Tensor) -> torch.Tensor:
        y = linear(x)
        for v in linear.weight.schedule:  # type: ignore[attr-defined]
            y = y * 0.5 + v
        return y

    jitted, x = ptj.jit(step), torch.ones(4)
    for _ in range(2):
        torch.testing.assert_close(jitted(x), step(x))
    jitted.wait_compiled()
    linear.weight.schedule.append(3.0)  # type: ignore[attr-defined]
    torch.testing.assert_close(jitted(x), step(x))
    assert jitted.num_traces == 2


def test_an_iterator_set_on_a_bias_draws_as_eager_code_does() -> None:
    """An iterator the step advances is state no program repeats: the step runs eagerly,
    warned; before, the compiled calls repeated the traced draw (1, 2, 2, 2, 2)."""
    linear = nn.Linear(1, 1)
    linear.bias.source = iter([1.0, 2.0, 3.0, 4.0, 5.0])  # type: ignore[attr-defined]

    def step(x: torch.Tensor) -> torch.Tensor:
        return linear(x) * 0 + next(linear.bias.source)  # type: ignore[attr-defined]

    jitted = ptj.jit(step)
    with pytest.warns(ptj.JitWarning, match="runs eagerly"):
        drawn = [float(jitted(torch.zeros(1)).detach()) for _ in range(5)]
    assert drawn == [1.0, 2.0, 3.0, 4.0, 5.0]


class _Slotted(nn.Module):
    __slots__ = ("n",)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x = x * 2 + 1
        return x


def test_a_slot_of_a_module_class_of_yours_is_guarded() -> None:
    module = _Slotted()
    module.n = 2
    jitted, x = ptj.jit(lambda x: module(x)), torch.ones(4)
    for _ in range(2):
        torch.testing.assert_close(jitted(x), module(x))
    jitted.wait_compiled()
    module.n = 3
    torch.testing.assert_close(jitted(x), torch.full((4,), 15.0))
    assert jitted.num_traces == 2


class _Knob(float):
    pass


class _Knobbed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.k = _Knob(2.0)
        self.k.offset = 0.0  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k + self.k.offset  # type: ignore[attr-defined]


def test_the_attributes_of_a_number_of_your_subclass_held_by_a_module_are_guarded() -> None:
    module = _Knobbed()
    jitted, x = ptj.jit(lambda x: module(x)), torch.ones(4)
    for _ in range(2):
        torch.testing.assert_close(jitted(x), module(x))
    jitted.wait_compiled()
    module.k.offset = 5.0  # type: ignore[attr-defined]
    torch.testing.assert_close(jitted(x), torch.full((4,), 7.0))
    assert jitted.num_traces == 2


def test_what_a_c_method_held_by_a_module_is_bound_to_is_read() -> None:
    """Probe round 35: a module attribute holding a C method bound to data was skipped as
    code: ``m.lookup = cfg.get`` with ``cfg`` changed in place, ``m.scaled = W.mul`` with
    ``W`` written in place (stale once compiled), an iterator's ``__next__`` (its draws
    repeated). Each is read through the object it is bound to."""
    cfg, weight = {"k": 2.0}, torch.tensor(2.0)
    module = nn.Module()
    module.lookup = cfg.get  # type: ignore[assignment]
    module.scaled = weight.mul  # type: ignore[assignment]

    def step(x: torch.Tensor) -> torch.Tensor:
        return module.scaled(x) * module.lookup("k")  # type: ignore[operator]

    jitted, x = ptj.jit(step), torch.ones(3)
    for k in (2.0, 3.0, 3.0, -1.0):
        cfg["k"] = k
        for _ in range(2):
            torch.testing.assert_close(jitted(x), step(x))
            jitted.wait_compiled()
        weight.add_(1.0)
    module.draw = iter([1.0, 2.0, 3.0, 4.0]).__next__  # type: ignore[assignment]
    drawing = ptj.jit(lambda x: x * module.draw())  # type: ignore[operator]
    with pytest.warns(ptj.JitWarning, match="runs eagerly"):
        drawn = [float(drawing(torch.ones(1))) for _ in range(4)]
    assert drawn == [1.0, 2.0, 3.0, 4.0]
