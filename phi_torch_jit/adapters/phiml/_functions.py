"""PhiML's custom-gradient ``autograd.Function`` classes: the forward we compile, the scope of
their backward (NOTE [PhiML bridge] in docs/design.md)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ...extend import ClosureRoot
from ._backend_patches import SPARSE_COO

__all__ = ["is_custom_function", "backward_scope", "traceable_forward", "closure_roots"]


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


def closure_roots(cls: type) -> tuple[ClosureRoot, ...]:
    """Where a PhiML custom-gradient Function class holds its call's auxiliary arguments: the
    ``auxiliary_kwargs`` of the signature key its native forward (and backward) closes over.

    PhiML passes a solve's ``Solve`` (with its initial guess ``x0``) and a function solve's
    keyword arguments as auxiliary arguments, not as tensors of the call, and makes the class
    anew for each call whose auxiliary arguments differ by value. Compiled as recorded, the
    class would keep the first call's initial guess: a solve stopped after a few iterations
    returned another result than eager's, and a NaN guess did not diverge. Their tensors
    become inputs of the custom function instead. Other classes: none. A PhiML whose native
    forward keeps no ``in_key``: the whole forward function is the root (walked whole)."""
    if not is_custom_function(cls):
        return ()
    function: Any = cls.__dict__.get("forward")
    function = getattr(function, "__func__", function)
    code = getattr(function, "__code__", None)
    if code is None or "f" not in code.co_freevars:
        return ()
    cell = code.co_freevars.index("f")
    native = function.__closure__[cell].cell_contents
    native_code = getattr(native, "__code__", None)
    if native_code is None or "in_key" not in native_code.co_freevars:
        return (("forward", cell, ()),)
    key = ("closure", native_code.co_freevars.index("in_key"))
    return (("forward", cell, (key, ("attr", "auxiliary_kwargs"))),)
