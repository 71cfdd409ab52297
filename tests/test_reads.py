"""Python state a jitted function reads: guarded, retraced when it changes, never baked stale.

Every test compares with the same code run eagerly, on both engines (shared suite).
"""

from __future__ import annotations

import logging
import random
import re
import time
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from helpers import captures_graph
from torch import nn

import phi_torch_jit as ptj
from phi_torch_jit._reads import Kind, PythonGuard, collect_reads

pytestmark = pytest.mark.all_engines

SCALE = 2.0
CONFIG: dict[str, Any] = {"gain": 1.5, "mode": "add"}
OFFSET = torch.ones(3)
MODEL = nn.Linear(3, 3)


def _configured(u: torch.Tensor) -> torch.Tensor:
    out = u * SCALE * CONFIG["gain"]
    return out + OFFSET if CONFIG["mode"] == "add" else out - OFFSET


def test_closure_time_step_changed_by_a_driver_loop_retraces(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dt = 0.1

    def step(u: torch.Tensor) -> torch.Tensor:
        return u + dt * torch.sin(u)

    jitted = ptj.jit(step)
    u = torch.linspace(0, 1, 5)
    with caplog.at_level(logging.INFO, logger="phi_torch_jit"):
        for _ in range(3):
            assert torch.allclose(jitted(u), u + dt * torch.sin(u))
            dt = dt / 2  # an adaptive driver shrinks the step
    assert jitted.num_traces == 3
    assert any("closure dt (read at" in r.message and "0.1 -> 0.05" in r.message
               for r in caplog.records)  # fmt: skip


def test_unchanged_values_do_not_retrace() -> None:
    jitted = ptj.jit(_configured)
    u = torch.randn(3)
    for _ in range(4):
        assert torch.allclose(jitted(u), _configured(u))
    assert jitted.num_traces == 1


def test_globals_floats_and_config_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    jitted = ptj.jit(_configured)
    u = torch.randn(3)
    jitted(u)
    monkeypatch.setitem(CONFIG, "gain", 3.0)  # an entry changes: content guard
    assert torch.allclose(jitted(u), _configured(u))
    monkeypatch.setitem(CONFIG, "mode", "sub")
    assert torch.allclose(jitted(u), _configured(u))
    monkeypatch.setattr(__import__(__name__), "SCALE", 0.5)
    assert torch.allclose(jitted(u), _configured(u))
    assert jitted.num_traces == 4


def test_global_tensor_updated_in_place_and_reassigned(monkeypatch: pytest.MonkeyPatch) -> None:
    jitted = ptj.jit(_configured)
    u = torch.randn(3)
    for i in range(5):  # TorchScript's executor used to fold it into a constant
        OFFSET.add_(1.0)
        assert torch.allclose(jitted(u), _configured(u)), i
    monkeypatch.setattr(__import__(__name__), "OFFSET", torch.full((3,), -4.0))
    assert torch.allclose(jitted(u), _configured(u))
    assert jitted.num_traces == 1  # same metadata: an input, not a retrace
    monkeypatch.setattr(__import__(__name__), "OFFSET", torch.zeros(4))
    with pytest.raises(RuntimeError):  # eager raises too: shapes (3,) and (4,)
        jitted(u)


def test_closure_tensor_requiring_grad_gets_its_gradient() -> None:
    weight = torch.randn(3, requires_grad=True)
    jitted = ptj.jit(lambda x: (x * weight).sin().sum())
    x = torch.randn(3)
    for _ in range(3):
        weight.grad = None
        jitted(x).backward()
        assert weight.grad is not None and torch.allclose(weight.grad, x * (x * weight).cos())


def test_global_model_name_rebound_to_another_model(monkeypatch: pytest.MonkeyPatch) -> None:
    def predict(x: torch.Tensor) -> torch.Tensor:
        return MODEL(x)

    jitted = ptj.jit(predict)
    x = torch.randn(2, 3)
    assert torch.allclose(jitted(x), MODEL(x))
    reloaded = nn.Linear(3, 3)
    monkeypatch.setattr(__import__(__name__), "MODEL", reloaded)
    assert torch.allclose(jitted(x), reloaded(x))


class Annealed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act: nn.Module = nn.ReLU()
        self.drop = nn.Dropout(0.5)
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.drop(self.act(self.lin(x))) / self.temperature, -1)


def test_module_attributes_and_replaced_submodules(caplog: pytest.LogCaptureFixture) -> None:
    net = Annealed()
    jitted = ptj.jit(net)
    x = torch.randn(8, 4)
    with caplog.at_level(logging.INFO, logger="phi_torch_jit"):
        for temperature in (1.0, 0.5, 0.25):  # annealed between calls
            net.temperature = temperature
            torch.manual_seed(3)
            got = jitted(x)
            torch.manual_seed(3)
            assert torch.allclose(got, net(x))
        net.drop.p = 0.1  # a scheduled dropout rate
        net.eval()
        assert torch.allclose(jitted(x), net(x))
        net.act = nn.Tanh()
        assert torch.allclose(jitted(x), net(x))
        net.lin = nn.Linear(4, 4)
        assert torch.allclose(jitted(x), net(x))
    messages = " ".join(r.message for r in caplog.records)
    assert "attribute Annealed.temperature: 1.0 -> 0.5" in messages
    assert "submodule Annealed.act replaced: ReLU -> new Tanh" in messages


def _noisy_python(u: torch.Tensor) -> torch.Tensor:
    return u * random.random()


def _noisy_numpy(u: torch.Tensor) -> torch.Tensor:
    return u * float(np.random.rand())


def _clocked(u: torch.Tensor) -> torch.Tensor:
    return u * (time.time() % 1.0 + 1.0)


def _reseeding(u: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(0)
    return u + torch.rand(3)


@pytest.mark.parametrize("fn", [_noisy_python, _noisy_numpy, _clocked, _reseeding])
def test_unguardable_reads_run_eagerly_with_one_warning(fn: Any) -> None:
    jitted = ptj.jit(fn)
    u = torch.ones(3)
    with pytest.warns(ptj.JitWarning, match="runs eagerly") as record:
        first = jitted(u)
    assert len(record) == 1 and fn.__name__ in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        results = [jitted(u) for _ in range(3)]
    if fn is _reseeding:
        assert all(torch.equal(r, first) for r in results)  # the same seed: eager's result
    else:
        assert len({float(r[0]) for r in [first, *results]}) == 4  # a new value on every call
    assert "runs eagerly" in jitted.explain()


def _target_network(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        target = MODEL(x) * 2
    return ((MODEL(x) - target) ** 2).sum()


def test_no_grad_blocks_give_eager_gradients(jit_engine: str) -> None:
    jitted = ptj.jit(_target_network)
    x = torch.randn(4, 3)
    MODEL.zero_grad()
    _target_network(x).backward()
    want = MODEL.weight.grad.clone()  # type: ignore[union-attr]
    context = pytest.warns(ptj.JitWarning, match="grad mode")
    if captures_graph(jit_engine):  # engines compile and auto keep grad-mode changes
        context = warnings.catch_warnings()  # type: ignore[assignment]
    with context:
        for _ in range(3):
            MODEL.zero_grad()
            jitted(x).backward()
            assert torch.allclose(MODEL.weight.grad, want)  # type: ignore[arg-type]
    compiled = not jitted.specializations[0].eager_reason
    assert compiled == captures_graph(jit_engine)


def test_tensor_hooks_run_eagerly_and_reverse_gradients() -> None:
    def reversed_grad(x: torch.Tensor) -> torch.Tensor:
        y = x * 3
        y.register_hook(lambda g: -g)
        return y.sum()

    jitted = ptj.jit(reversed_grad)
    x = torch.ones(2, requires_grad=True)
    with pytest.warns(ptj.JitWarning, match="tensor hooks"):
        jitted(x).backward()
    assert torch.equal(x.grad, torch.full((2,), -3.0))  # type: ignore[arg-type]


def test_helpers_and_module_methods_are_walked_statically() -> None:
    class Scaled(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.helper(x)

        def helper(self, x: torch.Tensor) -> torch.Tensor:
            return x * SCALE

    def outer(x: torch.Tensor) -> torch.Tensor:
        return _configured(x)

    reads = collect_reads(outer, [])
    labels = {r.source.label: r.kind for r in reads}
    assert labels["global SCALE"] is Kind.VALUE and labels["global CONFIG"] is Kind.CONTENT
    assert labels["global OFFSET"] is Kind.TENSOR and labels["global _configured"] is Kind.IDENTITY
    assert "global SCALE" in {r.source.label for r in collect_reads(lambda x: x, [Scaled()])}


def test_python_guard_describes_the_first_change() -> None:
    box = {"k": 1}
    count = 3

    def f() -> int:
        return box["k"] + count

    reads = [r for r in collect_reads(f, []) if r.source.label.startswith("closure")]
    (read_box, read_count) = sorted(reads, key=lambda r: r.source.label)
    guard = PythonGuard([read_box, read_count])
    assert guard.holds() and len(guard) == 2
    box["k"] = 2
    assert not guard.holds()
    assert guard.describe_change().startswith("closure box (read at")
    assert guard.describe_change().endswith("{'k': 1} -> {'k': 2}")
    assert count == 3


def _count(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    n = x.nonzero().shape[0]
    return x * n, n


def test_ints_derived_from_tensor_values_are_never_baked() -> None:
    jitted = ptj.jit(_count)
    uniq = ptj.jit(lambda x: torch.unique(x).shape[0] * x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for values in ([1.0, 0.0, 2.0], [1.0, 1.0, 2.0], [0.0, 0.0, 0.0]):
            x = torch.tensor(values)
            got, want = jitted(x), _count(x)
            assert got[1] == want[1] and type(got[1]) is int and torch.equal(got[0], want[0])
        for values in ([1.0, 1.0, 2.0], [1.0, 3.0, 2.0]):
            x = torch.tensor(values)
            assert torch.equal(uniq(x), torch.unique(x).shape[0] * x)
    ours = [str(w.message) for w in caught if issubclass(w.category, ptj.JitWarning)]
    assert len(ours) <= 2  # engines capturing a graph run both eagerly, each said once
    assert all("depends on tensor values" in m for m in ours), ours


def test_numpy_conversions_are_guarded_like_item() -> None:
    jitted = ptj.jit(lambda x: x * float(np.asarray(x).sum()) + float(x.numpy()[0]))
    for fill in (1.0, 2.0, 1.0):
        x = torch.full((2,), fill, device="cpu")  # numpy reads CPU tensors only
        assert torch.equal(jitted(x), x * float(x.sum()) + fill)
    assert jitted.num_traces == 2  # one per branch of values, reused


def test_module_moved_to_another_dtype_retraces() -> None:
    net = nn.Linear(3, 3)
    jitted = ptj.jit(lambda x: net(x.to(net.weight.dtype)))
    x = torch.ones(3)
    assert jitted(x).dtype == torch.float32
    net.double()
    assert jitted(x).dtype == torch.float64 and torch.allclose(jitted(x), net(x.double()))


def test_autocast_then_plain_calls_return_eagers_dtypes() -> None:
    net = nn.Linear(3, 3)
    jitted = ptj.jit(lambda x: net(x))
    x = torch.ones(2, 3)
    for autocast in (True, False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            got, want = jitted(x), net(x)
        assert got.dtype == want.dtype and torch.allclose(got.float(), want.float())
    assert jitted.num_traces == 2


def test_torch_func_transforms_inside_and_around_a_jitted_function() -> None:
    inner = ptj.jit(lambda x: torch.func.vmap(torch.sin)(x) * 2)
    x = torch.randn(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ptj.JitWarning)  # engine compile: runs eagerly
        assert torch.allclose(inner(x), torch.sin(x) * 2)
    outer = ptj.jit(lambda x: x.sin() * 2)
    assert torch.allclose(torch.func.vmap(outer)(x), torch.sin(x) * 2)
    assert torch.allclose(torch.func.grad(lambda y: outer(y).sum())(x[0]), 2 * torch.cos(x[0]))


TABLE = np.array([1.0, 2.0, 3.0])


def _lookup(x: torch.Tensor) -> torch.Tensor:
    return x * torch.from_numpy(TABLE).float()


@pytest.mark.filterwarnings("ignore:torch.from_numpy results are registered as constants")
def test_small_numpy_arrays_are_guarded_by_content() -> None:
    """torch's TracerWarning is right in general; here the array is guarded (docs/guarded.md)."""
    jitted = ptj.jit(_lookup)
    x = torch.ones(3, device="cpu")  # from_numpy makes CPU tensors
    try:
        for value in (1.0, 10.0, 10.0, 1.0):
            TABLE[0] = value  # updated in place between calls
            assert torch.equal(jitted(x), _lookup(x))
    finally:
        TABLE[0] = 1.0
    assert jitted.num_traces == 2


BIG_TABLE = np.ones(5000, dtype=np.float32)


def _big_lookup(x: torch.Tensor) -> torch.Tensor:
    return x * torch.from_numpy(BIG_TABLE)[: x.shape[0]]


@pytest.mark.filterwarnings("ignore:torch.from_numpy results are registered as constants")
def test_a_big_numpy_array_guarded_by_identity_only_is_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Over 4096 elements an array is not compared at every call: a change in place is not
    seen, and the trace says so (logged, and listed by explain()), never silently."""
    with caplog.at_level(logging.WARNING, logger="phi_torch_jit"):
        jitted = ptj.jit(_big_lookup)
        assert torch.equal(jitted(torch.ones(3)), _big_lookup(torch.ones(3)))
    assert any("reads global BIG_TABLE (at " in r.message and "5000 elements" in r.message
               for r in caplog.records)  # fmt: skip
    assert re.search(r"not guarded: 5000 elements", jitted.explain())


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mask = torch.ones(3)  # a plain tensor attribute, not a registered buffer
        self.scales = [1.0, 2.0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.mask * self.scales[1]


def test_plain_tensor_and_list_attributes_of_modules() -> None:
    net = Masked()
    jitted = ptj.jit(net)
    x = torch.ones(3)
    assert torch.equal(jitted(x), net(x))
    net.mask[0] = 5.0  # in place: an input of the program, seen without a retrace
    assert torch.equal(jitted(x), net(x)) and jitted.num_traces == 1
    net.scales[1] = 3.0  # a list entry: guarded by content
    assert torch.equal(jitted(x), net(x))
    net.mask = torch.zeros(3)  # reassigned
    assert torch.equal(jitted(x), net(x)) and jitted.num_traces == 2


LOOKUP = {f"k{i}": float(i) for i in range(100)}  # a table of 100 entries read by key
HUGE = {f"k{i}": [float(i)] for i in range(3000)}  # 9000 items: beyond what is compared


def _looked_up(x: torch.Tensor, key: str) -> torch.Tensor:
    return x * LOOKUP[key]


def test_a_table_of_a_hundred_numbers_is_guarded_by_content() -> None:
    """An entry far past the first 64 changed in place: retraced (it was kept before)."""
    jitted = ptj.jit(_looked_up)
    x = torch.ones(2)
    try:
        for value in (90.0, 91.0, 91.0, 5.0):
            LOOKUP["k90"] = value
            assert torch.equal(jitted(x, "k90"), _looked_up(x, "k90"))
    finally:
        LOOKUP["k90"] = 90.0
    assert jitted.num_traces == 3
    (read,) = [r for r in collect_reads(_looked_up, []) if r.source.label == "global LOOKUP"]
    assert read.kind is Kind.CONTENT


def _huge(x: torch.Tensor, key: str) -> torch.Tensor:
    return x + HUGE[key][0]


def test_a_big_table_past_the_walks_limits_is_compared_whole(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """3000 one-number lists: past the walk's 512 reads the table is compared whole (one
    ``==``), so an entry changed in place past them retraces, and nothing is said unguarded
    (what is too big even so: ``test_reads_overflow``)."""
    x = torch.ones(2)
    jitted = ptj.jit(_huge)
    try:
        with caplog.at_level(logging.WARNING, logger="phi_torch_jit"):
            for value in (2900.0, 2900.0, 7.0, 7.0):
                HUGE["k2900"][0] = value
                assert torch.equal(jitted(x, "k2900"), _huge(x, "k2900"))
    finally:
        HUGE["k2900"][0] = 2900.0
    assert jitted.num_traces == 2
    assert "not guarded" not in jitted.explain()
    assert not any("not guarded" in r.getMessage() for r in caplog.records)


class _Marked(torch.Tensor):
    """A plain tensor subclass (no ``__torch_function__`` of its own)."""


def test_an_alias_made_by_as_subclass_runs_eagerly_never_baked() -> None:
    """``(t * G).as_subclass(torch.Tensor)`` makes a new tensor without an op: a graph
    capture held it as a constant, the first call's value (found by a probe: a global
    subclass tensor changed in place or rebound was never seen)."""
    weight = torch.ones(3).as_subclass(_Marked)

    def step(t: torch.Tensor) -> torch.Tensor:
        return (t * weight).as_subclass(torch.Tensor) + 1

    jitted = ptj.jit(step)
    with pytest.warns(ptj.JitWarning, match="as_subclass"):
        for i in range(3):
            x = torch.full((3,), float(i))
            torch.testing.assert_close(jitted(x), step(x))
    weight.mul_(3)
    torch.testing.assert_close(jitted(torch.ones(3)), step(torch.ones(3)))


def test_an_alias_made_by_from_dlpack_runs_eagerly_never_baked() -> None:
    """``torch.from_dlpack(G)`` shares G's memory without an op, as ``as_subclass`` does: a
    graph held the first call's tensor (found by a probe: G rebound was never seen)."""
    state = {"g": torch.ones(3)}

    def step(t: torch.Tensor) -> torch.Tensor:
        return t * torch.from_dlpack(state["g"])

    jitted = ptj.jit(step)
    with pytest.warns(ptj.JitWarning, match="from_dlpack"):
        for i in range(3):
            state["g"] = torch.full((3,), float(i + 2))
            torch.testing.assert_close(jitted(torch.ones(3)), step(torch.ones(3)))
