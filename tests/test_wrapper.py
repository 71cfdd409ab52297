"""Stage 3: the wrapper module and what its trace contains."""

from __future__ import annotations

import pytest
import torch
from helpers import make_solve
from torch import nn

import phi_torch_jit as ptj
from phi_torch_jit._context import Frame, Phase, entered
from phi_torch_jit._signature import flatten_arguments
from phi_torch_jit._wrapper import make_wrapper


def test_wrapper_is_named_after_function_and_holds_tensors_by_reference() -> None:
    net = nn.Linear(2, 2)
    tied = nn.Linear(2, 2)
    tied.weight = net.weight  # shared parameters are held once
    net.register_buffer("scale", torch.ones(1))

    def my_step(x: torch.Tensor, scale: float) -> tuple[torch.Tensor, str]:
        return tied(net(x)) * scale, "done"

    spec, tensors = flatten_arguments((torch.ones(2), 3.0), {}, "my_step")
    wrapper = make_wrapper(my_step, spec, [net, tied], "my_step")
    assert type(wrapper).__name__ == "my_step_jit"
    held = dict(wrapper.tensors.named_parameters())
    assert list(held) == ["m0_Linear__weight", "m0_Linear__bias", "m1_Linear__bias"]
    assert held["m0_Linear__weight"] is net.weight and held["m1_Linear__bias"] is tied.bias
    assert dict(wrapper.tensors.named_buffers())["m0_Linear__scale"] is net.scale
    frame = Frame(Phase.TRACE, "my_step")
    with entered(frame):
        (out,) = wrapper(*tensors)
    assert torch.allclose(out, tied(net(torch.ones(2))) * 3.0)
    spec = frame.outputs.spec  # the wrapper reports its result's structure to the trace stage
    assert spec is not None and spec[2][1] == ("S", str, "done")


@pytest.mark.uses_torchscript  # engine "torchscript"
def test_trace_holds_one_opaque_node_per_custom_call() -> None:
    solve = make_solve()
    net = nn.Linear(8, 8)

    @ptj.jit(engine="torchscript")  # reads its TorchScript graph
    def step(u: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return solve(solve(net(u), k), k)

    step(torch.randn(8), torch.tensor(0.1))
    (spec,) = step.specializations
    graph = getattr(spec.program, "fn", spec.program).graph  # the traced forward
    kinds = [node.kind() for node in graph.nodes()]
    (call,) = spec.calls
    assert kinds.count(f"phi_torch_jit::{call.op_name}") == 2
    assert "aten::roll" not in kinds  # nothing of the CG leaked into the wrapper's graph
    assert "aten::linear" in kinds  # the Linear, with its weight read from the holder
    names = [n.s("name") for n in graph.nodes() if n.kind() == "prim::GetAttr"]
    assert "m0_Linear__weight" in names
