"""Stage 0: argument specs, cache keys and their readable differences."""

from __future__ import annotations

import dataclasses
import enum
import types
from collections import namedtuple
from decimal import Decimal
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import phi_torch_jit as ptj
from phi_torch_jit import OutputError, SignatureError
from phi_torch_jit._signature import (
    flatten_arguments,
    flatten_outputs,
    modules_in,
    unflatten,
    unflatten_arguments,
)
from phi_torch_jit._spec_text import describe_spec, first_difference

Point = namedtuple("Point", ["x", "y"])


@dataclasses.dataclass(frozen=True)
class State:
    u: torch.Tensor
    t: float


class Color(enum.Enum):
    RED = 1


def key(*args: Any, **kwargs: Any) -> Any:
    return flatten_arguments(args, kwargs, "f")[0]


def test_round_trip_nested_containers() -> None:
    a, b, c = torch.randn(2), torch.randn(3, 1), torch.randn(1)
    args = ((a, [b, 1.5]), {"p": Point(c, None), "s": State(a, 0.1)})
    kwargs = {"mode": Color.RED, "dt": 0.1}
    spec, tensors = flatten_arguments(args, kwargs, "f")
    assert [id(t) for t in tensors] == [id(a), id(b), id(c), id(a)]
    new = [t + 1 for t in tensors]
    rebuilt_args, rebuilt_kwargs = unflatten_arguments(spec, new)
    assert rebuilt_kwargs == kwargs
    (pair, d) = rebuilt_args
    assert isinstance(pair, tuple) and isinstance(pair[1], list) and pair[1][1] == 1.5
    assert pair[0] is new[0] and pair[1][0] is new[1]
    assert isinstance(d["p"], Point) and d["p"].x is new[2] and d["p"].y is None
    assert isinstance(d["s"], State) and d["s"].u is new[3] and d["s"].t == 0.1


def test_output_round_trip_keeps_static_leaves() -> None:
    out = {"u": torch.ones(2), "info": ("converged", 3)}
    spec, tensors = flatten_outputs(out, "f")
    rebuilt = unflatten(spec, iter(tensors))
    assert rebuilt["info"] == ("converged", 3) and rebuilt["u"] is tensors[0]


def test_tensor_metadata_is_keyed() -> None:
    x = torch.zeros(2, 3)
    base = key(x)
    assert key(torch.ones(2, 3)) == base  # values are not keyed
    assert key(torch.zeros(3, 2)) != base
    assert key(torch.zeros(2, 3, dtype=torch.float64)) != base
    assert key(torch.zeros(2, 3, requires_grad=True)) != base


def test_tensor_layout_and_class_are_keyed() -> None:
    """Strides (a view with gaps, a transpose) and the tensor's class: traced Python may read
    ``stride()``, ``is_contiguous()`` or ``isinstance`` (a trace baked the first layout)."""

    class Tagged(torch.Tensor):
        pass

    base = torch.ones(3, 2)
    assert key(base[:, 0]) != key(torch.ones(3)) and key(base.t()) != key(torch.ones(2, 3))
    assert key(torch.ones(3).as_subclass(Tagged)) != key(torch.ones(3))
    change = first_difference(key(torch.ones(3)), key(base[:, 0]), ["y"])
    assert change == "y: strides (1,) -> (2,)"


def test_negative_zero_is_keyed_apart_from_zero() -> None:
    """``-0.0 == 0.0`` and both hash alike, but ``1 / x`` and ``copysign`` tell them apart."""
    assert key(-0.0) != key(0.0) and key(0.0) == key(0.0) and key(-0.0) == key(-0.0)
    args, _ = unflatten_arguments(key(-0.0), [])
    assert str(args[0]) == "-0.0"


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ({0: 1.0}, {0.0: 1.0}),
        ({1: 1.0}, {True: 1.0}),
        ({0.0: 1.0}, {-0.0: 1.0}),
        (np.float64(0.0), np.float64(-0.0)),
        (Decimal("0"), Decimal("-0")),
        (Decimal("1"), Decimal("1.0")),
        (0j, complex(-0.0, 0.0)),
        (complex(1.0, 0.0), complex(1.0, -0.0)),
        (range(0, 4, 2), range(0, 3, 2)),
    ],
    ids=[
        "int-float-key",
        "int-bool-key",
        "zero-key-sign",
        "numpy-zero",
        "decimal-zero",
        "decimal-digits",
        "complex-zero",
        "complex-imag-zero",
        "range",
    ],
)
def test_values_equal_by_eq_but_read_apart_are_keyed_apart(one: Any, other: Any) -> None:
    """``==`` calls these equal, and they hash alike; a program reading them may differ
    (``1 / x``, ``type(k)``, ``str(d)``, ``r.stop``): each its own specialization (probe 43c).
    Each still round-trips as itself."""
    assert one == other and key(one) != key(other) and key(one) == key(one)
    args, _ = unflatten_arguments(key(other), [])
    assert repr(args[0]) == repr(other)


def test_what_python_may_read_of_a_tensor_argument_is_keyed() -> None:
    """Its autograd status (``is_leaf``, ``grad_fn is None``), a complex view's conj and neg
    bits, and the Python attributes set on it: a branch on each was baked (probe 45b)."""
    leaf = torch.ones(2, requires_grad=True)
    assert key(leaf) != key(leaf * 1)
    z = torch.tensor([1 + 2j, 3 - 1j])
    assert key(z) != key(z.conj()) and key(z) != key(torch._neg_view(z)) and key(z) == key(z)
    x, y = torch.ones(2), torch.ones(2)
    x.scale = 2.0  # type: ignore[attr-defined]
    assert key(x) != key(y)
    y.scale = 2.0  # type: ignore[attr-defined]
    assert key(x) == key(y)
    y.scale = 5  # type: ignore[attr-defined]
    assert key(x) != key(y)
    assert first_difference(key(x), key(y)).startswith("args[0]: attributes")


@pytest.mark.parametrize("read", ["getattr with a default", "hasattr", "is_leaf", "is_conj"])
def test_a_tensor_arguments_python_state_read_in_the_step_is_like_eager(read: str) -> None:
    steps = {
        "getattr with a default": lambda x: x * getattr(x, "scale", 1.0),
        "hasattr": lambda x: x * (2.0 if hasattr(x, "flag") else 3.0),
        "is_leaf": lambda x: x * (2.0 if x.is_leaf else 3.0),
        "is_conj": lambda x: x * (2.0 if x.is_conj() else 3.0),
    }
    step = steps[read]
    jitted = ptj.jit(step)
    base = torch.tensor([1 + 2j, 3 - 1j]) if read == "is_conj" else torch.ones(2)
    x = base.clone().requires_grad_(read == "is_leaf")
    for _ in range(3):
        torch.testing.assert_close(jitted(x), step(x))
    jitted.wait_compiled()
    x.scale = 5.0  # type: ignore[attr-defined]
    x.flag = True  # type: ignore[attr-defined]
    for other in (x, x * 1 if read == "is_leaf" else base.conj()):
        torch.testing.assert_close(jitted(other), step(other))


_FACTOR = [2.0]


def _times_factor(t: torch.Tensor) -> torch.Tensor:
    return t * _FACTOR[0]


class _Knob:
    def __init__(self) -> None:
        self.k = 2.0


_HELD_ON_A_TENSOR: dict[str, tuple[Any, Any, Any]] = {  # (set on x, step, change)
    "a namespace": (lambda: types.SimpleNamespace(k=2.0), lambda x: x * x.held.k,
                    lambda held: setattr(held, "k", 3.0)),
    "a dict of a list": (lambda: {"k": [2.0]}, lambda x: x * x.held["k"][0],
                         lambda held: held["k"].__setitem__(0, 3.0)),
    "an object of yours": (_Knob, lambda x: x * x.held.k, lambda held: setattr(held, "k", 3.0)),
    "an array": (lambda: np.array([2.0]), lambda x: x * float(x.held[0]),
                 lambda held: held.__setitem__(0, 3.0)),
    "a function reading a global": (lambda: _times_factor, lambda x: x.held(x),
                                    lambda held: _FACTOR.__setitem__(0, 3.0)),
    "a tensor written in place": (lambda: torch.tensor(2.0), lambda x: x * x.held,
                                  lambda held: held.fill_(3.0)),
    "in a tuple argument": (lambda: types.SimpleNamespace(k=2.0),
                            lambda pair: pair[0] * pair[0].held.k,
                            lambda held: setattr(held, "k", 3.0)),
}  # fmt: skip


@pytest.mark.all_engines
@pytest.mark.parametrize("held", list(_HELD_ON_A_TENSOR))
def test_what_a_tensor_arguments_python_attributes_hold_is_guarded(held: str) -> None:
    """An object set on a tensor argument (``x.cfg = SimpleNamespace(k=2.0)``, a function, an
    array, a tensor) was keyed by identity only: ``x.cfg.k = 3.0``, a global the function
    reads, or the tensor written in place kept the first value, on every engine (probe 46a).
    What the step reads of it is now guarded, rooted at it; a tensor by its writes."""
    make, step, change = _HELD_ON_A_TENSOR[held]
    try:
        x = torch.arange(1.0, 4.0)
        x.held = make()  # type: ignore[attr-defined]
        args: tuple[Any, ...] = ((x, 1),) if held == "in a tuple argument" else (x,)
        jitted = ptj.jit(step)
        for _ in range(3):
            torch.testing.assert_close(jitted(*args), step(*args))
        change(x.held)  # type: ignore[attr-defined]
        torch.testing.assert_close(jitted(*args), step(*args))
        jitted.wait_compiled()
        torch.testing.assert_close(jitted(*args), step(*args))
        assert jitted.num_traces == 2
    finally:
        _FACTOR[0] = 2.0


def test_a_dict_argument_keyed_apart_by_its_key_types_retraces() -> None:
    def step(x: torch.Tensor, table: dict[Any, float]) -> torch.Tensor:
        (k,) = table
        return x * table[k] if isinstance(k, float) else x + table[k]

    jitted, x = ptj.jit(step), torch.ones(3)
    for table in ({1: 2.0}, {1.0: 2.0}, {True: 2.0}):
        torch.testing.assert_close(jitted(x, table), step(x, table))
    assert jitted.num_traces == 3


def test_static_values_keyed_by_type_and_value() -> None:
    assert key(1) != key(1.0) != key(True)
    assert key(0.1) == key(0.1) and key(0.1) != key(0.2)
    assert key(x=1, y=2) == key(y=2, x=1)  # keyword order does not matter
    assert key((1, "a", None)) == key((1, "a", None))


def test_modules_are_keyed_by_identity() -> None:
    m1, m2 = nn.Linear(2, 2), nn.Linear(2, 2)
    assert key(m1) == key(m1) and key(m1) != key(m2)
    assert modules_in(key(m1, {"net": m2})) == [m1, m2]


def test_unhashable_static_value_names_the_argument() -> None:
    with pytest.raises(SignatureError, match=r"argument `state\['opts'\]` of f .*unhashable"):
        flatten_arguments(({"opts": {1, 2}},), {}, "f", ("state",))
    with pytest.raises(SignatureError, match=r"argument `cfg` of f"):
        flatten_arguments((), {"cfg": {1}}, "f")


def test_identity_hashed_objects_are_rejected_with_path() -> None:
    class Config:
        pass

    with pytest.raises(SignatureError, match=r"`args\[0\]\[1\]` .*Config has no value-based hash"):
        flatten_arguments(((1, Config()),), {}, "f")


def test_callables_are_static_by_identity() -> None:
    def op(x: torch.Tensor) -> torch.Tensor:
        return x

    assert key(op) == key(op)


def test_unsupported_output_names_its_path() -> None:
    with pytest.raises(OutputError, match=r"output `output\['a'\]\[1\]`"):
        flatten_outputs({"a": (torch.ones(1), {3})}, "f")


def test_first_difference_names_path_and_change() -> None:
    old = key({"u": torch.zeros(4)}, 0.1)
    assert first_difference(old, key({"u": torch.zeros(8)}, 0.1), ("state", "dt")) == (
        "state['u']: shape (4,) -> (8,)"
    )
    assert first_difference(old, key({"u": torch.zeros(4)}, 0.2), ("state", "dt")) == (
        "dt: 0.1 -> 0.2"
    )


def test_describe_spec_is_readable() -> None:
    text = describe_spec(key(torch.zeros(2, 3, requires_grad=True), dt=0.5))
    assert text == "(Tensor[2, 3] float32 cpu requires_grad, dt=0.5)"


def test_numbers_the_trace_computed_become_computed_leaves() -> None:
    from phi_torch_jit._signature import count_program_outputs, merge_traced_numbers

    recorded, _ = flatten_outputs((torch.ones(2), 3, {"n": 2.5, "tag": "a"}), "f")
    traced, _ = flatten_outputs(
        (torch.ones(2), torch.tensor(3), {"n": torch.tensor(2.5), "tag": "a"}), "f"
    )
    merged = merge_traced_numbers(recorded, traced)
    assert merged is not None and count_program_outputs(merged) == 3
    value = unflatten(merged, iter([torch.zeros(2), torch.tensor(7), torch.tensor(0.5)]))
    assert value[1] == 7 and type(value[1]) is int and value[2] == {"n": 0.5, "tag": "a"}
    assert merge_traced_numbers(recorded, recorded) == recorded
    other, _ = flatten_outputs((torch.ones(2), "x", {"n": 2.5, "tag": "a"}), "f")
    assert merge_traced_numbers(other, traced) is None  # a string cannot be computed


def test_keywords_a_function_takes_as_kwargs_are_keyed_in_the_calls_order() -> None:
    """``for k, v in kw.items()`` follows the call's order (probe 36c: ``f(x, b=3, a=2)``
    after ``f(x, a=2, b=3)`` served the first order's program). Named keyword parameters
    cannot be looped over: one specialization for both orders."""
    import phi_torch_jit as ptj

    def looped(x: torch.Tensor, **kw: float) -> torch.Tensor:
        for v in kw.values():
            x = x * v + 1
        return x

    def named(x: torch.Tensor, *, a: float = 1.0, b: float = 1.0) -> torch.Tensor:
        return (x * a + 1) * b + 1

    x = torch.ones(1)
    for fn, traces in ((looped, 2), (named, 1)):
        jitted = ptj.jit(fn)
        for _ in range(3):
            torch.testing.assert_close(jitted(x, a=2.0, b=3.0), fn(x, a=2.0, b=3.0))
        for _ in range(3):
            torch.testing.assert_close(jitted(x, b=3.0, a=2.0), fn(x, b=3.0, a=2.0))
        assert jitted.num_traces == traces


def test_a_shape_passed_as_an_argument_is_keyed_by_value() -> None:
    """``torch.Size`` (``x.shape`` passed on) was refused as a subclass of tuple (probe 36c)."""
    import phi_torch_jit as ptj

    def scaled(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        for d in shape:
            x = x * d
        return x

    jitted = ptj.jit(scaled)
    for x in (torch.ones(2, 3), torch.ones(2, 3), torch.ones(4, 3), torch.ones(2, 3)):
        torch.testing.assert_close(jitted(torch.ones(1), x.shape), scaled(torch.ones(1), x.shape))
    assert jitted.num_traces == 2
