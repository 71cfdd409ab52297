"""Real-tensor captures make their metadata with one fake mode (phi_torch_jit._fast_capture)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._subclasses import fake_tensor
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.proxy_tensor import make_fx

from phi_torch_jit._fast_capture import fast_metadata


def program(x: torch.Tensor, w: torch.nn.Parameter) -> torch.Tensor:
    y = torch.tanh(x @ w).t().contiguous()
    return (y[1:] * 2).sum(0)


def _metas(graph: torch.fx.GraphModule) -> list[Any]:
    return [
        (n.name, v.shape, v.stride(), v.dtype, v.device)
        for n in graph.graph.nodes
        if isinstance(v := n.meta.get("val"), torch.Tensor)
    ]


def _constructions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    made: list[int] = []
    original = fake_tensor.FakeTensorMode.__init__

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        made.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(fake_tensor.FakeTensorMode, "__init__", counting)
    return made


def test_metadata_equals_torchs_and_needs_no_mode_per_op(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w = torch.randn(4, 3), torch.nn.Parameter(torch.randn(3, 5))
    made = _constructions(monkeypatch)
    plain = make_fx(program, tracing_mode="real")(x, w)
    per_op = len(made)
    made.clear()
    with fast_metadata():
        fast = make_fx(program, tracing_mode="real")(x, w)
    assert _metas(fast) == _metas(plain) and fast.code == plain.code
    assert per_op >= 6 and len(made) <= 1  # one mode for this thread, made once
    assert proxy_tensor.extract_val.__name__ == "extract_val"
    assert not hasattr(proxy_tensor.extract_val, "__wrapped__")  # torch's own again
