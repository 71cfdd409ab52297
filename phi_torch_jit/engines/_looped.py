"""Engines "compile" and "auto": custom-function bodies whose loops run as compiled blocks.

A body that TorchScript cannot trace faithfully (its loop exits on tensor values) goes to
loop capture (``phi_torch_jit._loops``, docs/loops.md): each capturable loop runs as blocks of
predicated iterations compiled by the engine's backend. The captured function is run once on
the recorded inputs and must reproduce the recorded outputs; otherwise, or when no loop can be
captured, the body keeps what the ``functions`` engine made of it, and the reason is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from .._loops import capture_loops
from .base import CompiledFunction, FunctionTarget
from .torchscript import _AsTuple, _reproduces

__all__ = ["with_captured_loops"]

logger = logging.getLogger("phi_torch_jit")


def with_captured_loops(
    target: FunctionTarget,
    compile_graph: Callable[[torch.fx.GraphModule, tuple[torch.Tensor, ...]], Any] | None,
    lock: Any,
) -> CompiledFunction | None:
    """The body with its loops captured, checked against the recording; None if it cannot be
    (logged at INFO with the reason)."""
    if target.expected is None and target.reference is None:
        return None
    if target.loop_source is not None and target.with_loop_source is not None:
        source, wrap = target.loop_source, target.with_loop_source
    elif target.scriptable is not None:
        source, wrap = target.scriptable, _AsTuple
    else:
        return None
    captured = capture_loops(source, target.label, compile_graph, lock=lock)
    if isinstance(captured, str):
        _not_captured(target, captured)
        return None
    run = wrap(captured.function)
    expected = target.expected
    try:
        if expected is None:
            assert target.reference is not None
            with torch.no_grad():
                expected = target.reference()
    except Exception as error:  # the Python function itself fails on these inputs
        _not_captured(target, f"{type(error).__name__}: {error}".splitlines()[0])
        return None
    try:
        with torch.no_grad():
            actual = run(*target.example_inputs)
    except Exception as error:  # the captured function cannot run these inputs
        _not_captured(target, f"{type(error).__name__}: {error}".splitlines()[0])
        return None
    if not _reproduces(actual, expected):
        _not_captured(target, "the captured loop did not reproduce the recorded outputs")
        return None
    eager = sorted(reason for loop in captured.loops for reason in loop.eager_reasons)
    if eager:  # its iterations would run eagerly, with copies and merges: slower than Python
        _not_captured(target, f"a block cannot be traced for the recorded inputs: {eager[0]}")
        return None
    return CompiledFunction(run, "looped", captured.describe())


def _not_captured(target: FunctionTarget, reason: str) -> None:
    logger.info("phi_torch_jit: %s: loops not captured: %s", target.label, reason)
