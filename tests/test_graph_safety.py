"""Which custom-function ops a CUDA graph may capture (``phi_torch_jit._graph_safety``),
decided and checked on the CPU: an op whose body reads values on the host is tagged
``cudagraph_unsafe`` so inductor splits the program around it under ``mode="reduce-overhead"``."""

from __future__ import annotations

import pytest
import torch

import phi_torch_jit as ptj
from phi_torch_jit.engines import get_engine

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _tags(jitted: ptj.JitFunction) -> tuple[list[object], list[object]]:
    (call,) = jitted.specializations[0].calls
    forward = getattr(torch.ops.phi_torch_jit, call.op_name).default
    return list(forward.tags), list(call.backward_op.tags)


def _scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _halve_until_small(x: torch.Tensor) -> torch.Tensor:
    while bool(x.abs().max() > 1):
        x = x / 2
    return x


scale = ptj.custom_gradient(_scale, lambda i, o, g: (g[0] * 2,), name="scale")
halve = ptj.custom_gradient(_halve_until_small, lambda i, o, g: (g[0],), name="halve")


ENGINES = [
    pytest.param(options, marks=pytest.mark.uses_torchscript)  # "compile": TorchScript bodies
    for options in ({"engine": "torchscript"}, {"engine": "compile", "backend": "aot_eager"})
]


@pytest.mark.parametrize("options", ENGINES, ids=["torchscript", "compile"])
def test_a_traced_body_stays_in_the_graph_and_a_looping_one_is_a_boundary(options: dict) -> None:
    unsafe = torch.Tag.cudagraph_unsafe
    traced = ptj.jit(lambda x: scale(x) + 1, **options)
    traced(torch.ones(3))
    forward, backward = _tags(traced)
    assert unsafe not in forward and unsafe in backward  # a backward compiles on demand
    looping = ptj.jit(lambda x: halve(x) + 1, **options)
    looping(torch.full((3,), 10.0))
    forward, _ = _tags(looping)
    assert unsafe in forward  # a host check per iteration or block: never inside a graph


@pytest.mark.uses_torchscript  # engine "compile": TorchScript compiles its custom-function bodies
def test_reduce_overhead_turns_graph_partitioning_on_and_runs_on_the_cpu() -> None:
    engine = get_engine("compile", {"mode": "reduce-overhead"})
    assert engine.backend_settings().get("graph_partition") is True  # type: ignore[attr-defined]
    assert "graph_partition" not in get_engine("compile").backend_settings()  # type: ignore[attr-defined]
    jitted = ptj.jit(lambda x: halve(x) * 3, engine="compile", mode="reduce-overhead")
    for value in (10.0, 0.5, 300.0):
        x = torch.full((4,), value)
        torch.testing.assert_close(jitted(x), _halve_until_small(x) * 3)
