"""Tensors a custom function's body reads from Python state (_reads/_custom_bodies.py): its
compiled forward and backward hold them as constants, so a rebinding between calls retraces
(an update in place needs none). Found by a probe: output and gradient kept the old tensor."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines

W = torch.tensor(2.0, dtype=torch.float64)


class _Global(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * W + torch.sin(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * W  # (a wrong gradient on purpose: sin is left out, so W is what counts)


class _ClassHeld(torch.autograd.Function):
    weight = torch.tensor(2.0, dtype=torch.float64)

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * _ClassHeld.weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * _ClassHeld.weight


CFG = SimpleNamespace(w=torch.tensor(2.0, dtype=torch.float64))


class _OnConfig(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * CFG.w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * CFG.w


def _closing_over(weight: torch.Tensor) -> tuple[type, Callable[[torch.Tensor], None]]:
    class Closed(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * weight

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad * weight

    def rebind(new: torch.Tensor) -> None:
        nonlocal weight
        weight = new

    return Closed, rebind


def _outputs_and_gradients(step: Callable[..., Any]) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.linspace(0.5, 1.5, 3, dtype=torch.float64, requires_grad=True)
    out = step(x)
    out.sum().backward()
    assert x.grad is not None
    return out.detach(), x.grad


def _like_eager(function: Any, change: Callable[[], None], traces: int = 2) -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return function.apply(x) * 2

    jitted = ptj.jit(step)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for each in (lambda: None, change):
            each()
            for _ in range(3):
                got, want = _outputs_and_gradients(jitted), _outputs_and_gradients(step)
                torch.testing.assert_close(got, want)
            jitted.wait_compiled()
    assert jitted.num_traces == traces, jitted.explain()


def test_a_global_tensor_rebound_reaches_the_forward_and_the_backward() -> None:
    global W
    before = W
    try:
        _like_eager(_Global, lambda: globals().__setitem__("W", torch.tensor(-4.0).double()))
    finally:
        W = before


def test_a_global_tensor_updated_in_place_needs_no_retrace(jit_engine: str) -> None:
    if not jit_engine.startswith("auto"):  # the legacy engines' TorchScript bodies copy it
        pytest.skip("engines 'torchscript' and 'compile' bake its value (guarded.md)")
    before = W.clone()
    try:
        _like_eager(_Global, lambda: W.mul_(3), traces=1)
    finally:
        W.copy_(before)


def test_a_class_attribute_a_config_attribute_and_a_closure_rebound() -> None:
    before = _ClassHeld.weight, CFG.w
    try:
        _like_eager(_ClassHeld, lambda: setattr(_ClassHeld, "weight", torch.tensor(5.0).double()))
        _like_eager(_OnConfig, lambda: setattr(CFG, "w", torch.tensor(-1.5).double()))
    finally:
        _ClassHeld.weight, CFG.w = before
    closed, rebind = _closing_over(torch.tensor(2.0, dtype=torch.float64))
    _like_eager(closed, lambda: rebind(torch.tensor(7.0, dtype=torch.float64)))
