"""A custom function's op as a compile sees it (engines/_op_contracts.py): one definition for
the caller's real op and the compile worker's stand-in, the stand-in's gradient question
answered by the real op, and stand-ins that never run a body."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import re
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import phi_torch_jit as ptj
from phi_torch_jit.engines import _compile_process
from phi_torch_jit.engines._op_contracts import (
    OpContract,
    TensorMeta,
    contracts_in,
    present,
    stand_ins,
)

_NAMES = itertools.count()


def _scaled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w


def _only_xs_gradient(inputs: Any, outputs: Any, grads: Any) -> tuple[Any, ...]:
    return grads[0] * inputs[1], None  # w gets no gradient


SCALED = ptj.custom_gradient(_scaled, _only_xs_gradient, name="scaled")


def _jit(fn: Any) -> Any:
    return ptj.jit(fn, engine="compile", backend="aot_eager", torchscript=False, fallback="off")


def _compiled_call() -> tuple[Any, Any]:
    """A jitted step calling SCALED, and its one compiled call (which owns the op)."""
    step = _jit(lambda x, w: SCALED(torch.sin(x), w).sum())
    step(torch.randn(5, requires_grad=True), torch.randn(5))
    (call,) = step.specializations[0].calls
    return step, call


def _stand_in_of(contract: OpContract, ask: Any) -> Any:
    """A stand-in of ``contract`` under a fresh name, defined here (as in a worker)."""
    copy = dataclasses.replace(contract, name=f"{contract.name}_stand_in_{next(_NAMES)}")
    stand_ins([copy], ask)
    return copy, getattr(torch.ops.phi_torch_jit, copy.name).default


def _grad_graph(op: Any) -> str:
    """The code of a capture's trace (fake tensors) of the gradient through ``op``."""

    def grads(x: torch.Tensor, w: torch.Tensor) -> Any:
        out = op(torch.sin(x), w)
        return torch.autograd.grad(out.sum(), [x, w], allow_unused=True, materialize_grads=True)

    x, w = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
    return str(make_fx(grads, tracing_mode="fake")(x, w).code)


def test_a_stand_in_traces_the_gradient_as_the_real_op_does() -> None:
    """Same schema, same fake outputs, same None gradients: the worker's stand-in asks the
    caller's op which gradients are present, and the traced graphs are the same."""
    _step, call = _compiled_call()
    asked: list[tuple[Any, ...]] = []

    def ask(name: str, *question: Any) -> tuple[bool, ...]:
        asked.append((name, question[0]))
        return present(call.contract.name, *question)

    copy, stand_in = _stand_in_of(call.contract, ask)
    real = _grad_graph(call.op)
    there = _grad_graph(stand_in)
    assert asked == [(copy.name, (True, True))]
    assert "_bwd" in real and "zeros" in real  # w's gradient: None, materialized as zeros
    assert re.sub(copy.name, call.contract.name, there) == real


def test_a_stand_in_never_runs_a_body() -> None:
    _step, call = _compiled_call()
    copy, stand_in = _stand_in_of(call.contract, lambda *question: (True, False))
    x, w = torch.randn(5), torch.randn(5)
    with pytest.raises(RuntimeError, match="cannot run a custom function's body"):
        stand_in(x, w)
    backward_op = getattr(torch.ops.phi_torch_jit, copy.backward_name).default
    with pytest.raises(RuntimeError, match="cannot run a custom function's body"):
        backward_op([x, w, x], [x], [True, False])
    with pytest.raises(RuntimeError, match="cannot run a custom function's body"):
        stand_in(x.requires_grad_(), w).sum().backward()  # type: ignore[no-untyped-call]


def test_a_name_defined_with_another_contract_is_refused() -> None:
    _step, call = _compiled_call()
    copy, _ = _stand_in_of(call.contract, lambda *question: (True, False))
    stand_ins([copy], lambda *question: (True, False))  # the same again: nothing to do
    other = dataclasses.replace(copy, kept=not copy.kept)
    with pytest.raises(ValueError, match="two contracts"):
        stand_ins([other], lambda *question: (True, False))


def test_the_contracts_a_graph_needs_and_the_graphs_that_need_others() -> None:
    step, call = _compiled_call()
    x, w, op = torch.randn(5), torch.randn(5), call.op
    ours = make_fx(lambda x, w: op(torch.sin(x), w) + 1)(x, w)
    assert contracts_in(ours) == [call.contract]
    assert contracts_in(make_fx(lambda x: torch.sin(x))(x)) == []
    library = torch.library.Library("ptj_test_contracts", "FRAGMENT")
    library.define("twice(Tensor x) -> Tensor")
    library.impl("twice", lambda x: 2 * x, "CompositeExplicitAutograd")
    theirs = make_fx(lambda x: torch.ops.ptj_test_contracts.twice(x))(x)
    assert contracts_in(theirs) is None  # a library's op: the worker could not define it
    del step, call
    gc.collect()
    assert contracts_in(ours) is None  # the op is gone: nobody can answer for it


def test_the_caller_answers_for_its_ops_and_reports_what_it_cannot() -> None:
    _step, call = _compiled_call()
    saved = [TensorMeta.of(torch.randn(5))] * 3
    grads = [TensorMeta.of(torch.randn(5))]
    answer = _compile_process._answer(call.contract.name, (True, True), saved, grads)
    assert answer == {"present": (True, False)}
    unknown = _compile_process._answer("no_such_op_0", (True, True), saved, grads)
    assert "KeyError" in unknown["error"]


def test_a_gradient_that_raises_is_reported_to_the_worker() -> None:
    def broken(inputs: Any, outputs: Any, grads: Any) -> Any:
        raise ValueError("no gradient for you")

    fails = ptj.custom_gradient(_scaled, broken, name="fails")
    step = _jit(lambda x, w: fails(x, w).sum())
    step(torch.randn(5), torch.randn(5))
    (call,) = step.specializations[0].calls
    saved = [TensorMeta.of(torch.randn(5))] * 3
    answer = _compile_process._answer(call.contract.name, (True, True), saved, saved[:1])
    assert "no gradient for you" in answer["error"]
