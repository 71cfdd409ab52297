"""Engine ``"eager"``: no compilation at all, for debugging.

A jitted function with this engine calls the user function directly: no
record pass, no cache, no trace. ``PHI_TORCH_JIT_DISABLE=1`` selects it for
every jitted function created while it is set.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import CompiledFunction, CompiledModule, Engine, FunctionTarget

__all__ = ["EagerEngine"]


class EagerEngine(Engine):
    """Runs everything as Python."""

    name = "eager"
    passthrough = True
    keeps_grad_mode = True

    def compile_function(self, target: FunctionTarget) -> CompiledFunction:
        return CompiledFunction(target.fn, "python", "engine 'eager' compiles nothing")

    def compile_module(
        self, module: nn.Module, example_inputs: tuple[torch.Tensor, ...], label: str
    ) -> CompiledModule:
        return CompiledModule(module)
