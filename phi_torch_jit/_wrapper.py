"""Stage 3: the synthesized wrapper module that the engine traces.

``torch.jit.trace`` of a plain function turns module parameters it meets into
constants (and refuses those that require grad). Tracing a module whose
submodules own those parameters instead records them as attributes, so
gradients reach ``param.grad`` and in-place updates (``optimizer.step()``) are
seen without a retrace. The wrapper holds every recorded root module as a
submodule, rebuilds the user's arguments from flat tensors, calls the user
function and flattens its result. Its class is named after the user function
so traced graphs and errors read well.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from ._signature import Spec, flatten_outputs, unflatten_arguments

__all__ = ["WrapperModule", "make_wrapper"]


class WrapperModule(nn.Module):
    """Calls a user function on flat tensors; owns the modules it uses."""

    fn: Callable[..., Any]
    arg_spec: Spec
    owner: str
    output_spec: Spec | None

    def __init__(
        self, fn: Callable[..., Any], arg_spec: Spec, modules: Sequence[nn.Module], owner: str
    ) -> None:
        super().__init__()
        # Plain attributes, set past nn.Module.__setattr__ so a module `fn` is not registered twice.
        object.__setattr__(self, "fn", fn)
        object.__setattr__(self, "arg_spec", arg_spec)
        object.__setattr__(self, "owner", owner)
        object.__setattr__(self, "output_spec", None)
        for i, module in enumerate(modules):
            self.add_module(f"m{i}_{type(module).__name__}", module)

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args, kwargs = unflatten_arguments(self.arg_spec, tensors)
        spec, flat = flatten_outputs(self.fn(*args, **kwargs), self.owner)
        object.__setattr__(self, "output_spec", spec)
        return tuple(flat)


def make_wrapper(
    fn: Callable[..., Any], arg_spec: Spec, modules: Sequence[nn.Module], owner: str
) -> WrapperModule:
    """A :class:`WrapperModule` of a subclass named after ``fn``."""
    name = getattr(fn, "__name__", None) or type(fn).__name__
    ident = re.sub(r"\W", "_", name).strip("_") or "function"
    cls = type(f"{ident}_jit", (WrapperModule,), {"__module__": __name__})
    return cast(WrapperModule, cls(fn, arg_spec, modules, owner))
