"""Stage 1, ``_type_tests`` (record) and ``_reads/_type_tests`` (guard): what
``isinstance``/``issubclass`` answered against abstract base classes is guarded answer by
answer. ``ABC.register(C)`` retraces where it changes an answer the step got (probe 41a), and
only there: guarding ``abc.get_cache_token()`` wherever code spelled ``isinstance`` retraced
a step twice after its first call on the default engine, at the registrations of the
libraries torch imports while it compiles (sympy's numbers)."""

from __future__ import annotations

import abc
import collections.abc
import numbers
from typing import Any, Protocol, runtime_checkable

import pytest
import torch
from helpers import like_eager_then_retraced

import phi_torch_jit as ptj
from phi_torch_jit import _type_tests

pytestmark = pytest.mark.all_engines


class _Plain:
    k = 2.0


def _fresh_abc() -> type:
    class Scalable(abc.ABC):  # noqa: B024 (no abstract methods: registered classes only)
        pass

    return Scalable


def test_a_registration_that_changes_an_answer_retraces() -> None:
    scalable, held = _fresh_abc(), _Plain()

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * held.k if isinstance(held, scalable) else x + 1

    like_eager_then_retraced(ptj.jit(step), step, lambda: scalable.register(_Plain))


def test_registrations_that_change_no_answer_do_not_retrace() -> None:
    """Another class registered with the ABC tested, and a class registered with another
    ABC (what importing sympy does): the answers are the same, no retrace."""
    scalable, other, held = _fresh_abc(), _fresh_abc(), _Plain()

    class Unrelated:
        pass

    def step(x: torch.Tensor) -> torch.Tensor:
        tensor_like = isinstance(x, collections.abc.Sequence)  # a library's ABC
        return x * held.k if isinstance(held, scalable) or tensor_like else x + 1

    def change() -> None:
        scalable.register(Unrelated)
        other.register(_Plain)
        numbers.Real.register(Unrelated)

    like_eager_then_retraced(ptj.jit(step), step, change, traces=1)


def test_a_step_testing_only_concrete_classes_reads_no_answers() -> None:
    """``isinstance(x, torch.Tensor)`` asks no ABC: nothing noted, nothing guarded."""

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * 2 if isinstance(x, (torch.Tensor, list)) else x

    jitted = ptj.jit(step)
    jitted(torch.ones(2))
    assert "isinstance/issubclass answers" not in jitted.explain()
    assert "abc.get_cache_token()" not in jitted.explain()
    _fresh_abc().register(float)
    jitted(torch.ones(2))
    assert jitted.num_traces == 1


def test_issubclass_against_an_abc_is_guarded() -> None:
    scalable = _fresh_abc()

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * 3 if issubclass(_Plain, scalable) else x

    like_eager_then_retraced(ptj.jit(step), step, lambda: scalable.register(_Plain))


@runtime_checkable
class _HasK(Protocol):
    k: float


class _Other:
    pass


def test_a_protocol_test_falls_back_to_the_registration_token() -> None:
    """A ``typing.Protocol`` answers by its own rules (the attributes an object has): the
    token every registration changes is guarded too, so a registration retraces, and the
    results stay eager's."""
    held: Any = _Other()

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * 2 if isinstance(held, _HasK) else x

    jitted = ptj.jit(step)
    torch.testing.assert_close(jitted(torch.ones(2)), step(torch.ones(2)))
    assert "abc.get_cache_token()" in jitted.explain()
    _fresh_abc().register(_Other)
    torch.testing.assert_close(jitted(torch.ones(2)), step(torch.ones(2)))
    assert jitted.num_traces == 2


def test_the_pairs_noted_are_bounded() -> None:
    """Past ``MAX_TYPE_TESTS`` pairs, the token is guarded instead of more answers."""
    classes = [type(f"C{i}", (), {}) for i in range(_type_tests.MAX_TYPE_TESTS + 5)]
    scalable = _fresh_abc()

    def step(x: torch.Tensor) -> torch.Tensor:
        hits = sum(isinstance(c(), scalable) for c in classes)
        return x + hits

    jitted = ptj.jit(step)
    torch.testing.assert_close(jitted(torch.ones(2)), step(torch.ones(2)))
    assert "abc.get_cache_token()" in jitted.explain()
    scalable.register(classes[-1])  # past the bound: seen through the token
    torch.testing.assert_close(jitted(torch.ones(2)), step(torch.ones(2)))


def test_a_librarys_test_of_a_class_of_yours_is_guarded() -> None:
    """Library code (here compiled under a site-packages path) testing an object of yours
    against an ABC: the pair is noted because the class is yours; the same site testing its
    own classes is not, and is not looked at again."""
    import sys

    scope: dict[str, Any] = {"numbers": numbers}
    library = f"{sys.prefix}/lib/python3.11/site-packages/a_library_of_theirs.py"
    exec(compile("def scale(v):\n    return 2.0 if isinstance(v, numbers.Real) else 1.0\n",
                 library, "exec"), scope)  # fmt: skip
    scale = scope["scale"]

    class Quantity:
        pass

    held = Quantity()

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * scale(held) * scale(1.5)

    like_eager_then_retraced(ptj.jit(step), step, lambda: numbers.Real.register(Quantity))
