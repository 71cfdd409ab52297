"""Guarded data-dependent control flow (issue 6, section 1)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from helpers import Counter
from torch import nn

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines


def branchy(x: torch.Tensor) -> torch.Tensor:
    if x.sum() > 0:
        return x * 2
    return -x


def test_guards_off_gives_the_traced_branch_guards_on_the_right_one(jit_engine: str) -> None:
    positive, negative = torch.ones(3), -torch.ones(3)
    unguarded = ptj.jit(branchy, on_guard_failure="off")
    if jit_engine == "torchscript":
        with pytest.warns(torch.jit.TracerWarning):
            unguarded(positive)
        assert torch.equal(unguarded(negative), negative * 2)  # wrong: the baked branch
    else:  # graph capture cannot bake a branch: it runs eagerly, says why
        with pytest.warns(ptj.JitWarning, match="on_guard_failure='off'"):
            unguarded(positive)
        assert torch.equal(unguarded(negative), -negative)

    guarded = ptj.jit(branchy)
    guarded(positive)
    assert torch.equal(guarded(negative), -negative)  # right
    assert torch.equal(guarded(positive), positive * 2)
    assert torch.equal(guarded(negative), -negative)
    assert guarded.num_traces == 2  # one specialization per branch, both cached


def test_int_float_item_and_tolist_conversions_are_guarded() -> None:
    def f(x: torch.Tensor, n: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        for _ in range(int(n)):
            x = x + 1
        return x * scale.item() + sum(scale.reshape(1).tolist())

    step = ptj.jit(f)
    x = torch.zeros(2)
    for n, s in [(2, 1.0), (3, 1.0), (2, 0.5), (2, 1.0)]:
        got = step(x, torch.tensor(n), torch.tensor(s))
        assert torch.allclose(got, f(x, torch.tensor(n), torch.tensor(s)))
    assert step.num_traces == 3


def test_eager_policy_runs_python_on_mismatch_without_retracing() -> None:
    counter = Counter()

    def f(x: torch.Tensor) -> torch.Tensor:
        counter.forward += 1
        return branchy(x)

    step = ptj.jit(f, on_guard_failure="eager")
    step(torch.ones(2))
    before = counter.forward
    assert torch.equal(step(-torch.ones(2)), torch.ones(2))
    assert counter.forward == before + 1 and step.num_traces == 1


def test_error_policy_names_location_and_values() -> None:
    step = ptj.jit(branchy, on_guard_failure="error")
    step(torch.ones(2))
    with pytest.raises(
        ptj.GuardError, match=r"bool\(\.\.\.\) at .*test_value_guards.py:\d+: True -> False"
    ):
        step(-torch.ones(2))


def test_invalid_policy_lists_accepted_values() -> None:
    with pytest.raises(ValueError, match=r"one of \('retrace', 'eager', 'error', 'off'\)"):
        ptj.jit(branchy, on_guard_failure="warn")


def test_explain_lists_guards_and_functions_without_conversions_have_none() -> None:
    step = ptj.jit(branchy)
    step(torch.ones(2))
    assert (
        "value guard: bool(...) at" in step.explain() and "test_value_guards.py" in step.explain()
    )
    plain = ptj.jit(lambda x: x * 2)
    plain(torch.ones(2))
    assert plain.specializations[0].value_guards == ()


def test_torch_internal_shape_checks_are_not_guarded() -> None:
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    step = ptj.jit(net)
    step(torch.randn(4, 3))
    assert step.specializations[0].value_guards == ()


def test_failed_guard_leaves_no_state_behind() -> None:
    bn = nn.BatchNorm1d(2)

    def f(x: torch.Tensor) -> torch.Tensor:
        y = bn(x)
        return y * 2 if x.mean() > 0 else y

    step = ptj.jit(f)
    step(torch.randn(4, 2) + 5)
    assert int(bn.num_batches_tracked) == 1
    step(torch.randn(4, 2) - 5)  # guard fails: the discarded run's updates are rolled back
    assert int(bn.num_batches_tracked) == 2
    step(torch.randn(4, 2) + 5)
    step(torch.randn(4, 2) - 5)
    assert int(bn.num_batches_tracked) == 4 and step.num_traces == 2


def test_gradients_flow_through_guarded_programs() -> None:
    step = ptj.jit(branchy)
    for sign in (1.0, -1.0, 1.0):
        x = torch.full((3,), sign, requires_grad=True)
        step(x).sum().backward()
        assert torch.equal(x.grad, torch.full((3,), 2.0 if sign > 0 else -1.0))


def test_failed_guard_rolls_back_random_draws() -> None:
    drop = nn.Dropout(0.5)

    def f(x: torch.Tensor) -> torch.Tensor:
        y = drop(x)
        return y * 2 if x.mean() > 0 else y

    step = ptj.jit(f)
    step(torch.ones(8))
    negative = -torch.ones(8)
    torch.manual_seed(7)
    got = step(negative)  # compiled run discarded, then the record pass runs
    got_next = torch.rand(3)
    torch.manual_seed(7)
    want = f(negative)
    want_next = torch.rand(3)
    assert torch.equal(got, want) and torch.equal(got_next, want_next)
    assert step.specializations[0].uses_rng


def test_values_read_inside_torch_ops_are_guarded(jit_engine: str) -> None:
    """A torch op that needs a number reads a tensor's value in C++ (``alpha=t``,
    ``x.repeat(n)``) or returns one (``torch.equal``): a graph capture refused these and the
    function ran eagerly (torchode's step-size controller, gpytorch's kernels). Now each is
    a guarded value like ``t.item()``: same values serve the program, new ones retrace.
    TorchScript traces ``alpha`` and ``repeat``'s count as values of the program, and baked
    ``torch.equal``'s branch silently until it was guarded."""

    def f(x: torch.Tensor, y: torch.Tensor, t: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        z = torch.add(x, y, alpha=t).repeat(n)
        assert not torch.equal(x, z)  # shapes differ: never equal, nothing to guard
        return z * 2 if torch.equal(x, y) else z - 1

    step = ptj.jit(f)
    x, y = torch.arange(3.0), torch.ones(3)
    cases = [(y, 0.5, 2), (y, 0.5, 2), (y, 2.0, 2), (y, 0.5, 3), (x, 0.5, 2), (y, 0.5, 2)]
    for other, t, n in cases:
        args = (x, other, torch.tensor(t), torch.tensor(n))
        assert torch.equal(step(*args), f(*args))
    # graph capture: (0.5, 2), (2.0, 2), (0.5, 3), unequal inputs; TorchScript: (un)equal
    assert step.num_traces == (2 if jit_engine == "torchscript" else 4)
    assert not [s for s in step.specializations if s.eager_reason]


@pytest.mark.parametrize("device_mode", [False, True], ids=["plain", "default-device"])
def test_a_value_torchs_own_module_reads_is_guarded_like_a_users(device_mode: bool) -> None:
    """BatchNorm with ``momentum=None`` averages with ``1 / float(num_batches_tracked)``, a
    value read in torch's Python: it was taken for a shape check and baked, so every later
    call overwrote the running statistics instead of averaging them (found by a probe). Also
    under ``with torch.device(...)``, a torch-function mode that relays every op."""
    with torch.device("cpu") if device_mode else contextlib.nullcontext():
        _batchnorm_without_momentum_like_eager()


def _batchnorm_without_momentum_like_eager() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 3)
    jitted_bn, eager_bn = nn.BatchNorm1d(3, momentum=None), nn.BatchNorm1d(3, momentum=None)
    step = ptj.jit(lambda t: jitted_bn(t) * 2)
    with pytest.warns(ptj.JitWarning, match="batchnorm.py"):  # a new value on every call
        for i in range(6):
            torch.testing.assert_close(step(x + i), eager_bn(x + i) * 2)
    torch.testing.assert_close(jitted_bn.running_mean, eager_bn.running_mean)
    torch.testing.assert_close(jitted_bn.running_var, eager_bn.running_var)
    assert step.num_traces >= 2


def test_a_value_torchs_module_reads_is_guarded_when_that_module_is_the_jitted_one() -> None:
    """``jit(nn.Sequential(..., nn.BatchNorm1d(8, momentum=None)))``: no user line calls into
    torch (our wrapper does), and the read was taken for our own and baked: the running
    statistics drifted from eager's (found by a probe)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3, momentum=None))
    reference = copy.deepcopy(net)
    step = ptj.jit(net)
    with pytest.warns(ptj.JitWarning, match="batchnorm.py"):  # a new value on every call
        for i in range(6):
            x = torch.randn(8, 3) + i
            torch.testing.assert_close(step(x), reference(x))
    torch.testing.assert_close(net[1].running_mean, reference[1].running_mean)
    torch.testing.assert_close(net[1].running_var, reference[1].running_var)
    assert step.num_traces >= 2 and "batchnorm.py:" in step.explain()


def test_batchnorm_without_momentum_in_eval_mode_reads_nothing_and_keeps_one_trace() -> None:
    """The same read where it does not change (evaluation mode: running statistics, no
    count): one trace, no guard; in training with a fixed momentum nothing is read either."""
    bn = nn.BatchNorm1d(3, momentum=None).eval()
    step = ptj.jit(bn)
    x = torch.randn(8, 3)
    for _ in range(3):
        torch.testing.assert_close(step(x), bn(x))
    assert step.num_traces == 1 and step.specializations[0].value_guards == ()


def test_a_read_relayed_by_a_torch_function_mode_is_guarded_once_at_the_users_line() -> None:
    """``torch.set_default_device`` / ``with torch.device(...)``: the mode's
    ``__torch_function__`` calls the conversion once more, from torch's file."""
    step = ptj.jit(branchy, on_guard_failure="error")
    with torch.device("cpu"):
        step(torch.ones(2))
        assert len(step.specializations[0].value_guards) == 1
        with pytest.raises(ptj.GuardError, match=r"at .*test_value_guards.py:\d+: True -> False"):
            step(-torch.ones(2))
