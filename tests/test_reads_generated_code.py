"""Code compiled from strings and run by classes' machinery (_reads._code_walk.user_function,
_reads._fields): a helper made by ``exec``, a dataclass's generated ``__init__`` calling its
``default_factory``, a metaclass's ``__call__``, an implementation registered later on a
``singledispatchmethod``. Each was found silently wrong by a probe: the walk had taken code
from ``<string>`` for generated code of a library's, or did not reach it. A step typed at a
prompt: tests/test_sources.py."""

from __future__ import annotations

from typing import Any

import generated_code as generated
import pytest
import torch
from helpers import like_eager_then_retraced

import phi_torch_jit as ptj
from phi_torch_jit._reads._code_walk import user_function

pytestmark = pytest.mark.all_engines


def test_a_helper_made_by_exec_has_its_globals_guarded() -> None:
    namespace: dict[str, Any] = {}
    exec("K = 2.0\ndef scale(x):\n    return x * K\n", namespace)
    scale = namespace["scale"]

    def step(x: torch.Tensor) -> torch.Tensor:
        return scale(x)

    like_eager_then_retraced(ptj.jit(step), step, lambda: namespace.update(K=3.0))


@pytest.mark.parametrize("name", ["<generated>", "<lambdifygenerated-1>", "<string>"])
def test_a_step_compiled_from_a_string_into_a_namespace_of_its_own_has_its_globals_guarded(
    name: str,
) -> None:
    """Generated code (a template, a symbolic library's code printer) under a file name of its
    own, in a namespace that names itself but is no module's: no globals were guarded (probe
    32), whatever the name."""
    namespace: dict[str, Any] = {"__name__": "generated_model"}
    source = "K = 2.0\ndef helper(x):\n    return x + K\ndef step(x):\n    return helper(x) * K\n"
    exec(compile(source, name, "exec"), namespace)
    step = namespace["step"]
    like_eager_then_retraced(ptj.jit(step), step, lambda: namespace.update(K=3.0))


def test_torchs_and_a_librarys_generated_code_are_not_the_users() -> None:
    traced = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    assert not user_function(type(traced).forward)  # <eval_with_key>: torch's
    assert user_function(generated.Made.__init__)  # a dataclass of a user's module
    import dataclasses

    library_made = dataclasses.make_dataclass("Made", [("a", int)])  # its code in module types
    assert not user_function(library_made.__init__)  # <string> in a library module's namespace


@pytest.fixture
def restored() -> Any:
    saved = generated.GAIN, generated.Meta.multiplier
    yield
    generated.GAIN, generated.Meta.multiplier = saved


def test_a_dataclass_default_factory_reading_a_global_is_walked(restored: Any) -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return x * generated.Made().coefficients[0]

    made = generated.Made  # read through a name of this module: no module path spells it

    def step_by_name(x: torch.Tensor) -> torch.Tensor:
        return x * made().coefficients[0]

    like_eager_then_retraced(ptj.jit(step_by_name), step_by_name,
                             lambda: setattr(generated, "GAIN", 3.0))  # fmt: skip
    like_eager_then_retraced(ptj.jit(step), step, lambda: setattr(generated, "GAIN", 5.0))


def test_a_metaclass_call_reading_its_attribute_is_walked(restored: Any) -> None:
    by_meta = generated.ByMeta

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * by_meta().m

    like_eager_then_retraced(ptj.jit(step), step,
                             lambda: setattr(generated.Meta, "multiplier", 3.0))  # fmt: skip


def test_an_implementation_registered_later_on_a_singledispatchmethod_retraces() -> None:
    dispatching = generated.Dispatching()

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * dispatching.scale(3)

    method = generated.Dispatching.__dict__["scale"]
    before = method.dispatcher.dispatch(int)
    try:
        like_eager_then_retraced(
            ptj.jit(step), step, lambda: method.register(int, lambda self, v: 100.0)
        )
    finally:
        method.register(int, before)
