"""Stage 3: the wrapper module and what its trace contains."""

from __future__ import annotations

import torch
from helpers import make_solve
from torch import nn

import phi_torch_jit as ptj
from phi_torch_jit._signature import flatten_arguments
from phi_torch_jit._wrapper import make_wrapper


def test_wrapper_is_named_after_function_and_owns_modules() -> None:
    net = nn.Linear(2, 2)

    def my_step(x: torch.Tensor, scale: float) -> tuple[torch.Tensor, str]:
        return net(x) * scale, "done"

    spec, tensors = flatten_arguments((torch.ones(2), 3.0), {}, "my_step")
    wrapper = make_wrapper(my_step, spec, [net], "my_step")
    assert type(wrapper).__name__ == "my_step_jit"
    assert dict(wrapper.named_children()) == {"m0_Linear": net}
    assert [p is q for p, q in zip(wrapper.parameters(), net.parameters())] == [True, True]
    (out,) = wrapper(*tensors)
    assert torch.allclose(out, net(torch.ones(2)) * 3.0)
    assert wrapper.output_spec is not None and wrapper.output_spec[2][1] == ("S", str, "done")


def test_trace_holds_one_opaque_node_per_custom_call() -> None:
    solve = make_solve()
    net = nn.Linear(8, 8)

    @ptj.jit
    def step(u: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return solve(solve(net(u), k), k)

    step(torch.randn(8), torch.tensor(0.1))
    (spec,) = step._cache.values()
    graph = spec.program.graph  # type: ignore[attr-defined]
    kinds = [node.kind() for node in graph.nodes()]
    (call,) = spec.calls
    assert kinds.count(f"phi_torch_jit::{call.op_name}") == 2
    assert "aten::roll" not in kinds  # nothing of the CG leaked into the wrapper's graph
    assert any(k == "prim::CallMethod" for k in kinds)  # the Linear, as a submodule
