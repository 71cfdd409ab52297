"""Rewinding and restoring tensor state: RNG streams, buffer values, version counters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from phi_torch_jit._state import StateSnapshot, capture_rng, restore_rng, rng_restored


def test_capture_and_restore_rng_round_trip() -> None:
    state = capture_rng()
    first = torch.rand(4)
    restore_rng(state)
    assert torch.equal(torch.rand(4), first)


def test_rng_restored_puts_the_stream_back_even_after_an_error() -> None:
    state = torch.get_rng_state()
    with pytest.raises(KeyError), rng_restored():
        torch.rand(5)
        raise KeyError("boom")
    assert torch.equal(torch.get_rng_state(), state)


def test_rewound_runs_from_the_state_before_and_restores_the_state_after() -> None:
    bn = nn.BatchNorm1d(2)
    snapshot = StateSnapshot()  # taken before the "record pass"
    snapshot.add_module(bn)
    before_mean = bn.running_mean.clone()
    drawn_in_record = torch.rand(3)
    bn(torch.randn(8, 2) + 5)  # the record pass updates the stats
    after_mean = bn.running_mean.clone()
    after_rng = torch.get_rng_state()
    version = bn.running_mean._version
    with snapshot.rewound():  # the "trace pass" sees the state before the record pass
        assert torch.equal(bn.running_mean, before_mean)
        assert torch.equal(torch.rand(3), drawn_in_record)
        bn(torch.randn(8, 2) - 5)
    assert torch.equal(bn.running_mean, after_mean)
    assert torch.equal(torch.get_rng_state(), after_rng)
    assert bn.running_mean._version == version  # autograd sees no in-place write


def test_rewound_restores_after_an_exception() -> None:
    buffer_module = nn.BatchNorm1d(1)
    snapshot = StateSnapshot()
    snapshot.add_module(buffer_module)
    buffer_module.running_mean.fill_(3.0)
    with pytest.raises(RuntimeError), snapshot.rewound():
        raise RuntimeError("trace failed")
    assert torch.equal(buffer_module.running_mean, torch.full((1,), 3.0))
