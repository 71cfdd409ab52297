"""The engine interface, its registry and the built-in engines."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from helpers import Counter, make_solve
from torch import nn

import phi_torch_jit as ptj
from phi_torch_jit.engines import (
    CompiledFunction,
    CompiledModule,
    Engine,
    FunctionTarget,
    available_engines,
    get_engine,
    register_engine,
)


def test_unknown_engine_lists_accepted_names() -> None:
    with pytest.raises(ValueError, match=r"unknown engine 'jax'; use one of \(") as raised:
        ptj.jit(lambda x: x, engine="jax")
    for name in ("auto", "compile", "eager", "torchscript"):  # and those the tests registered
        assert repr(name) in str(raised.value)
    assert {"auto", "compile", "eager", "torchscript"} <= set(available_engines())


def test_eager_engine_runs_python_every_call() -> None:
    counter = Counter()

    def f(x: torch.Tensor) -> torch.Tensor:
        counter.forward += 1
        return x * 2

    step = ptj.jit(f, engine="eager")
    step(torch.ones(2))
    step(torch.ones(2))
    assert counter.forward == 2 and step.num_traces == 0
    assert "runs eagerly" in step.explain()


def test_disable_env_var_forces_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHI_TORCH_JIT_DISABLE", "1")
    step = ptj.jit(lambda x: x + 1)
    assert step.engine.name == "eager"
    monkeypatch.setenv("PHI_TORCH_JIT_DISABLE", "0")
    monkeypatch.delenv("PHI_TORCH_JIT_ENGINE", raising=False)  # the test default (conftest)
    assert ptj.jit(lambda x: x + 1).engine.name == "auto"  # the default: no TorchScript


def test_deprecation_warnings_are_not_shown() -> None:
    # pytest turns warnings into errors (pyproject); a leaked DeprecationWarning would fail.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step = ptj.jit(lambda x: x.sin())
        step(torch.ones(3))
        step(torch.ones(4))
    assert step.num_traces == 2


@pytest.mark.uses_torchscript  # engine "torchscript"
def test_tracer_warnings_reach_the_user_when_value_guards_are_off() -> None:
    def branchy(x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum() > 0 else x

    step = ptj.jit(branchy, on_guard_failure="off", engine="torchscript")  # its tracer's
    with pytest.warns(torch.jit.TracerWarning, match="Python boolean"):
        step(torch.ones(2))
    assert "tracer warning: Converting a tensor to a Python boolean" in step.explain()


def test_captured_tensor_requiring_grad_on_a_plain_object_is_a_program_input() -> None:
    holder = SimpleNamespace(weight=torch.ones(3, requires_grad=True))
    step = ptj.jit(lambda x: x * holder.weight)
    step(torch.ones(3))
    with torch.no_grad():
        holder.weight.fill_(2.0)
    assert torch.equal(step(torch.ones(3)), torch.full((3,), 2.0))
    assert step.num_traces == 1 and "runs eagerly" not in step.explain()


class CountingEngine(Engine):
    """A custom engine: delegates to torchscript and counts what it compiles."""

    name = "counting"

    def __init__(self) -> None:
        self.inner = get_engine("torchscript")
        self.functions = 0
        self.modules = 0

    def compile_function(self, target: FunctionTarget) -> CompiledFunction:
        self.functions += 1
        return self.inner.compile_function(target)

    def compile_module(
        self, module: nn.Module, example_inputs: tuple[torch.Tensor, ...], label: str
    ) -> CompiledModule:
        self.modules += 1
        return self.inner.compile_module(module, example_inputs, label)


@pytest.mark.uses_torchscript  # delegates to engine "torchscript"
def test_custom_engine_plugs_in_by_instance_and_by_name() -> None:
    engine = CountingEngine()
    solve = make_solve()
    step = ptj.jit(lambda b, k: solve(b, k) * 2, engine=engine)
    b, k = torch.randn(5), torch.tensor(0.2)
    step(b, k)
    step(b, k)
    assert (engine.functions, engine.modules) == (1, 1)
    register_engine("counting", CountingEngine)
    assert isinstance(get_engine("counting"), CountingEngine)


def test_complex_gradients_stay_right_after_the_executor_optimizes() -> None:
    # TorchScript's optimizing executor returns wrong complex gradients from the second
    # call on (torch 2.13); the engine turns optimizations off for complex programs.
    def f(x: torch.Tensor) -> torch.Tensor:
        return x * x * 0.5

    step = ptj.jit(f)
    for _ in range(4):
        x = torch.randn(3, dtype=torch.complex64, requires_grad=True)
        (got,) = torch.autograd.grad((step(x).abs() ** 2).sum(), x)
        (want,) = torch.autograd.grad((f(x).abs() ** 2).sum(), x)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
