"""PhiML's custom-gradient ``autograd.Function`` classes: the forward we compile, the scope of
their backward (NOTE [PhiML bridge] in docs/design.md)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ._backend_patches import SPARSE_COO

__all__ = ["is_custom_function", "backward_scope", "traceable_forward"]


_CUSTOM_FUNCTION = ("phiml.backend.torch._torch_backend", "construct_torch_custom_function.")


def is_custom_function(cls: type) -> bool:
    return cls.__module__ == _CUSTOM_FUNCTION[0] and cls.__qualname__.startswith(
        _CUSTOM_FUNCTION[1]
    )


def backward_scope(cls: type) -> AbstractContextManager[Any] | None:
    """What a PhiML custom-gradient Function's backward runs in when we run it: its adjoint
    solve builds a sparse matrix with PhiML's ``sparse_coo_tensor``, which scripts itself with
    TorchScript on every call; built directly here (``_SparseCoo``), as in its forward. Other
    classes: None."""
    return SPARSE_COO.active() if is_custom_function(cls) else None


def traceable_forward(cls: type) -> Callable[..., Any] | None:
    """The forward to run for a PhiML custom-gradient Function class, or None for other classes.

    PhiML's Function answers any TorchScript trace with the output its own jit recorded
    (its trace pass must not run the solve twice). Our forward compile traces the forward on
    purpose, so it calls the function PhiML wraps directly -- PhiML's backend then takes its
    traced paths, e.g. the scripted CG loop -- and fills ctx as PhiML's forward does (inputs and
    outputs saved, ``input_count`` set), which PhiML's backward reads.
    """
    if not is_custom_function(cls):
        return None
    function: Any = cls.__dict__.get("forward")
    function = getattr(function, "__func__", function)
    code = getattr(function, "__code__", None)
    if code is None or not {"f", "jit_f"} <= set(code.co_freevars):
        return None  # a PhiML version we do not know: its own forward runs
    cells = dict(zip(code.co_freevars, function.__closure__))
    wrapped = cells["jit_f"].cell_contents or cells["f"].cell_contents

    def forward(ctx: Any, *args: Any) -> Any:
        with SPARSE_COO.active():
            outputs = wrapped(*args)
        ctx.save_for_backward(*args, *outputs)
        ctx.input_count = len(args)
        return outputs

    forward.__module__ = cls.__module__  # PhiML's code: its CG loops may be captured
    return forward
