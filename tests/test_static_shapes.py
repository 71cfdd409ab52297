"""Ops whose output size depends on values (phi_torch_jit._static_shapes, _value_sized,
engines._generic_sizes; NOTE [value-dependent sizes]): compiled, equal to eager; where nothing
read the size, one program serves every size; where Python read it or the graph baked it, the
size is guarded and a call with another size retraces instead of running a graph built for the
old one."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import captures_graph, gradcheck

import phi_torch_jit as ptj
from phi_torch_jit.engines._graph_bodies import data_dependent_shape

pytestmark = pytest.mark.all_engines

MASK_A = torch.tensor([True, False, True, False, False, True])
MASK_B = torch.tensor([False, True, True, True, False, False])  # as many True as MASK_A
MASK_C = torch.tensor([True, True, True, True, False, False])  # one more


def masked(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    picked = x[mask]
    return (picked * picked).sum(), picked + 1


def _compare(jitted: object, eager: object, *args: torch.Tensor) -> None:
    x = args[0]
    got = jitted(*args)  # type: ignore[operator]
    (g_got,) = torch.autograd.grad(got[0], x)
    want = eager(*args)  # type: ignore[operator]
    (g_want,) = torch.autograd.grad(want[0], x)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(g_got, g_want)


def test_a_boolean_index_is_compiled_and_follows_the_mask_of_each_call(jit_engine: str) -> None:
    step = ptj.jit(masked)
    x = torch.randn(6, 3, requires_grad=True)
    for mask in (MASK_A, MASK_B, MASK_A, MASK_B):
        _compare(step, masked, x, mask)
    assert step.num_traces == 1
    assert "runs eagerly" not in step.explain()


def test_another_number_of_true_entries_is_served_by_the_same_program(jit_engine: str) -> None:
    """Nothing reads the count: the graph keeps the index's dynamic form, not one per size."""
    step = ptj.jit(masked)
    x = torch.randn(6, 3, requires_grad=True)
    for mask in (MASK_A, MASK_C, MASK_A, MASK_C, MASK_C[[1, 2, 3, 4, 5, 0]].logical_not()):
        _compare(step, masked, x, mask)
    assert step.num_traces == 1
    assert "runs eagerly" not in step.explain()
    if captures_graph(jit_engine):
        assert "not checked: the program computes it for any values" in step.explain()


def mean_picked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    picked = x[mask]
    return picked.sum(0) / picked.shape[0]  # Python reads the count: the graph divides by 3


def put_picked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    y = torch.zeros(6, 3)
    y[mask] = x[mask] * 2  # one True entry: torch's setitem views the (1, 3) values to [3]
    return y


MASK_ONE = torch.tensor([False, False, True, False, False, False])


@pytest.mark.parametrize(
    "fn, masks",
    [(mean_picked, (MASK_A, MASK_C, MASK_A, MASK_C)),
     (put_picked, (MASK_ONE, MASK_A, MASK_ONE, MASK_C))],
    ids=["python-reads", "cpp-bakes"],
)  # fmt: skip
def test_a_size_python_reads_or_the_graph_bakes_stays_guarded_and_retraces(
    jit_engine: str, fn: Any, masks: tuple[torch.Tensor, ...]
) -> None:
    """Two programs each: the count read in Python stays guarded (3 and 4); the size setitem
    baked for one entry stays guarded, the program for three leaves it dynamic and serves four."""
    if fn is put_picked and not captures_graph(jit_engine):
        pytest.skip("TorchScript's trace of setitem bakes the view too (test_model_classes)")
    step = ptj.jit(fn)
    x = torch.randn(6, 3)
    for mask in masks:
        torch.testing.assert_close(step(x, mask), fn(x, mask))
    if captures_graph(jit_engine):  # TorchScript traces sizes
        assert step.num_traces == 2


def selections(
    x: torch.Tensor, mask: torch.Tensor, repeats: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    where = torch.nonzero(mask)
    rows, _ = torch.where(x > 0.5)
    chosen = torch.masked_select(x, mask[:, None])
    spread = torch.repeat_interleave(x[:, 0], repeats)
    counts = torch.repeat_interleave(repeats)
    total = chosen.sum() + spread.sum() + x[rows].sum() + where.sum()
    return total, chosen, spread, counts, rows


def test_nonzero_where_masked_select_and_repeat_interleave_equal_eager(
    jit_engine: str, device: torch.device
) -> None:
    step = ptj.jit(selections)
    x = torch.tensor([[0.1, 0.9], [0.7, 0.2], [0.3, 0.4], [0.8, 0.6], [0.0, 0.1], [0.2, 0.3]])
    x.requires_grad_(True)
    x_same_counts = torch.tensor([[0.9, 0.1], [0.2, 0.7], [0.4, 0.3], [0.6, 0.8], [0.1, 0.0],
                                  [0.3, 0.2]], requires_grad=True)  # fmt: skip
    repeats = torch.tensor([1, 0, 2, 1, 3, 0])
    shuffled = torch.tensor([0, 2, 1, 3, 0, 1])  # the same total
    if device.type == "cuda" and captures_graph(jit_engine):
        # repeat_interleave does not check output_size on CUDA, so it is not rewritten there
        # (NOTE [value-dependent sizes]): the step runs eagerly, warned once, equal to eager
        with pytest.warns(ptj.JitWarning, match="repeat_interleave"):
            _compare(step, selections, x, MASK_A, repeats)
        _compare(step, selections, x_same_counts, MASK_B, shuffled)
        return
    for args in [(x, MASK_A, repeats), (x_same_counts, MASK_B, shuffled), (x, MASK_A, repeats)]:
        _compare(step, selections, *args)
    assert step.num_traces == 1
    _compare(step, selections, x, MASK_C, repeats)  # a new size
    _compare(step, selections, x, MASK_A, torch.tensor([1, 1, 1, 1, 2, 2]))
    assert step.num_traces == 1  # nothing read the sizes: one program serves them all


def test_gradients_through_a_boolean_index_in_float64(jit_engine: str) -> None:
    step = ptj.jit(lambda x, mask: masked(x, mask)[1].sin())
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    assert gradcheck(step, (x, MASK_A))
    assert gradcheck(step, (x, MASK_B))


def noisy_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    noise = torch.nn.functional.dropout(torch.ones_like(x), 0.5)
    picked = (x * noise)[mask]
    return picked.sum() * picked.shape[0]  # the count read: guarded


def test_a_failed_size_guard_leaves_no_random_draws_behind(jit_engine: str) -> None:
    """The call built for the old size ran (its dropout drew numbers) before its guard failed:
    the draws are undone, so the retraced call and what follows draw as eager does."""
    step = ptj.jit(noisy_masked)
    x = torch.randn(6, 3)
    for mask in (MASK_A, MASK_A, MASK_C, MASK_A):
        torch.manual_seed(7)
        got = step(x, mask)
        after_jit = torch.rand(3)
        torch.manual_seed(7)
        want = noisy_masked(x, mask)
        after_eager = torch.rand(3)
        torch.testing.assert_close(got, want)
        assert torch.equal(after_jit, after_eager)


def test_the_error_policy_names_the_size_and_where_it_was_taken(jit_engine: str) -> None:
    if not captures_graph(jit_engine):
        pytest.skip("TorchScript traces sizes: no size guard")
    step = ptj.jit(mean_picked, on_guard_failure="error")
    x = torch.randn(6, 3)
    step(x, MASK_A)
    with pytest.raises(
        ptj.GuardError,
        match=r"test_static_shapes.py:\d+ \(the number of True entries of a boolean index\): "
        r"3 -> 4",
    ):
        step(x, MASK_C)


def test_with_guards_off_a_value_dependent_size_runs_eagerly_and_says_why(
    jit_engine: str,
) -> None:
    if not captures_graph(jit_engine):
        pytest.skip("TorchScript traces sizes")
    step = ptj.jit(masked, on_guard_failure="off")
    x = torch.randn(6, 3)
    with pytest.warns(ptj.JitWarning, match=r"would bake the output shape of aten.index.Tensor"):
        step(x, MASK_A)
    for mask in (MASK_C, MASK_A):
        for a, b in zip(step(x, mask), masked(x, mask)):
            torch.testing.assert_close(a, b)


def test_unique_of_floats_still_runs_eagerly_with_a_reason(jit_engine: str) -> None:
    """Integers and booleans have a static form (below); floats not (NaN, -0.0)."""
    if not captures_graph(jit_engine):
        pytest.skip("TorchScript traces sizes")

    def distinct(x: torch.Tensor) -> torch.Tensor:
        return torch.unique(x).sum()

    step = ptj.jit(distinct)
    with pytest.warns(ptj.JitWarning, match="would bake the output shape of aten._unique2"):
        step(torch.tensor([1.0, 2.0, 2.0]))
    assert step(torch.tensor([1.0, 2.0, 3.0])) == 6.0


def grouped(x: torch.Tensor, weights: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Sparse-matrix assembly as PhiML does it: distinct indices, and the entries of each
    summed by ``bincount``; ``v`` gathered by the inverse carries a gradient."""
    values, inverse, counts = torch.unique(x, return_inverse=True, return_counts=True)
    summed = torch.bincount(inverse, weights, minlength=2)
    along, along_inverse, along_counts = torch.unique(
        x, dim=-1, return_inverse=True, return_counts=True
    )
    loss = (v[inverse] ** 2).sum() + (values * counts).sum() + summed.sum()
    return loss, summed, torch.bincount(x), along * 2, along_inverse + along_counts.sum()


def test_unique_and_bincount_are_compiled_with_their_sizes_guarded(jit_engine: str) -> None:
    """PhiML builds a sparse matrix that changes every step (an obstacle passed as an
    argument) with ``torch.unique(dim=-1)`` and ``bincount``: the rotating-bar step ran eagerly
    (5x PhiML's own jit), and runs compiled now (0.33x). The number of distinct values and of
    bins are guarded: a call with others retraces, one with the same sizes does not."""
    if not captures_graph(jit_engine):
        pytest.skip("TorchScript traces sizes")
    step = ptj.jit(grouped)
    v = torch.randn(4, dtype=torch.float64, requires_grad=True)
    calls = (
        torch.tensor([3, 1, 3, 2]),
        torch.tensor([2, 1, 2, 3]),  # 3 distinct values, bins up to 3 again: the same program
        torch.tensor([5, 5, 1, 1]),  # 2 distinct, 6 bins: retraced
        torch.tensor([3, 1, 3, 2]),
    )
    for x in calls:
        weights = torch.rand(4, dtype=torch.float64)
        got, want = step(x, weights, v), grouped(x, weights, v)
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            torch.testing.assert_close(a, b)
        (g_got,) = torch.autograd.grad(got[0], v)
        (g_want,) = torch.autograd.grad(want[0], v)
        torch.testing.assert_close(g_got, g_want)
    assert step.num_traces == 2 and "runs eagerly" not in step.explain()
    assert "(the number of distinct values (unique))" in step.explain()
    assert gradcheck(lambda v: step(calls[0], weights, v)[0], (v,))


def test_bincount_of_a_negative_value_raises_as_eagerly_and_weights_with_gradients_run_eagerly(
    jit_engine: str,
) -> None:
    """The static form clamps indices; a negative value fails its guard, and the retrace
    raises what eager raises. Weights that require grad keep the op (bincount has no backward:
    eager raises at the backward), so the step runs eagerly."""
    if not captures_graph(jit_engine):
        pytest.skip("TorchScript traces sizes")
    step = ptj.jit(lambda x: torch.bincount(x, minlength=4) * 2)
    torch.testing.assert_close(step(torch.tensor([0, 2, 2])), torch.tensor([2, 0, 4, 0]))
    with pytest.raises(RuntimeError, match="non-negative"):
        step(torch.tensor([0, -1, 2]))
    weighted = ptj.jit(lambda x, w: torch.bincount(x, w))
    w = torch.rand(3, requires_grad=True)
    with pytest.warns(ptj.JitWarning, match="bincount"):
        torch.testing.assert_close(
            weighted(torch.tensor([0, 2, 2]), w), torch.bincount(torch.tensor([0, 2, 2]), w)
        )


def test_count_nonzero_is_not_taken_for_a_value_dependent_size() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(lambda x: torch.count_nonzero(x) + x.sum())(torch.ones(3))
    assert data_dependent_shape(graph) == ""
    graph = make_fx(lambda x: torch.nonzero(x))(torch.ones(3))
    assert data_dependent_shape(graph) == "aten.nonzero.default"


def test_a_program_that_raises_for_another_size_retraces_never_crashes() -> None:
    """``nn.AdaptiveLogSoftmaxWithLoss``: traced with every target in the head cluster, the
    program's static ``nonzero`` form indexes with its fill value when a later call's
    targets fall elsewhere, and ``index_copy_`` raised an IndexError before the size's value
    guard was checked (found by a probe). A program with value guards that raises is taken
    as a failed guard: nothing it wrote is kept, and the call is traced anew."""
    torch.manual_seed(0)
    head_only, spread = torch.tensor([0, 1, 2, 3, 4, 0]), torch.tensor([0, 7, 12, 3, 19, 8])
    model = torch.nn.AdaptiveLogSoftmaxWithLoss(8, 20, cutoffs=[5, 10], div_value=2.0)
    step = ptj.jit(lambda x, t: model(x, t).loss)
    x = torch.randn(6, 8)
    for target in (head_only, spread, head_only, spread):
        torch.testing.assert_close(step(x, target), model(x, target).loss)
    assert step.num_traces >= 2
