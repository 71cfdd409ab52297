"""End to end: the numbered behaviours of the core adapter (issue 2)."""

from __future__ import annotations

import dataclasses
import threading
import traceback
from collections import namedtuple
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from helpers import Counter, cg_loop, engine_name, gradcheck, make_solve, value_loop_mode
from torch import nn

import phi_torch_jit as ptj
from phi_torch_jit._context import current_frame

pytestmark = pytest.mark.all_engines

Fields = namedtuple("Fields", ["u", "v"])


@dataclasses.dataclass
class State:
    u: torch.Tensor
    time: float


class Source(nn.Module):
    def __init__(self, n: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n, dtype=dtype)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(u))


# -- 1. same results as eager ----------------------------------------------------------


def test_outputs_and_gradients_equal_eager_gradcheck() -> None:
    solve = make_solve()
    net = Source(8, torch.float64)

    def step(u: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return solve(u + 0.1 * net(u), k) * 2

    jitted = ptj.jit(step)
    u = torch.randn(8, dtype=torch.float64, requires_grad=True)
    k = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
    jitted(u, k)
    assert torch.allclose(jitted(u, k), step(u, k))
    grads = torch.autograd.grad(jitted(u, k).sum(), [u, k, net.lin.weight])
    want = torch.autograd.grad(step(u, k).sum(), [u, k, net.lin.weight])
    for g, w in zip(grads, want):
        assert torch.allclose(g, w)
    assert gradcheck(jitted, (u, k))
    assert jitted.num_traces == 1


# -- 2. signature cache ------------------------------------------------------------------


def test_retrace_rules_and_counter() -> None:
    counter = Counter()

    def f(x: torch.Tensor, scale: float, mode: str = "a") -> torch.Tensor:
        counter.forward += 1
        return x * scale if mode == "a" else x - scale

    step = ptj.jit(f)
    x = torch.randn(3)
    step(x, 2.0)
    step(torch.randn(3), 2.0)  # new values, same signature: reuse
    assert step.num_traces == 1 and counter.forward == 2  # record + trace
    step(x, 3.0)  # static value changed
    step(torch.randn(4), 2.0)  # shape changed
    step(x.double(), 2.0)  # dtype changed
    step(x.requires_grad_(), 2.0)  # requires_grad changed
    step(x, 2.0, mode="b")
    assert step.num_traces == 6
    with torch.no_grad():
        step(x, 2.0)  # grad mode changed
    assert step.num_traces == 7
    assert torch.equal(step(x, 2.0, mode="b"), x - 2.0)


def test_unhashable_static_argument_names_argument() -> None:
    step = ptj.jit(lambda x, opts: x)
    with pytest.raises(ptj.SignatureError, match=r"argument `opts\['tol'\]` of .*unhashable"):
        step(torch.ones(1), {"tol": {1e-5}})


def test_max_traces_warns_once_naming_the_change() -> None:
    step = ptj.jit(lambda x, dt: x * dt, max_traces=2)
    step(torch.ones(1), 0.1)
    step(torch.ones(1), 0.2)
    with pytest.warns(ptj.JitWarning, match=r"traced 3 times \(max_traces=2\).*dt: 0.2 -> 0.3"):
        step(torch.ones(1), 0.3)
    step(torch.ones(1), 0.4)  # no second warning (pytest would fail on it)
    assert step.num_traces == 4


def test_invalid_max_traces() -> None:
    with pytest.raises(ValueError, match="max_traces"):
        ptj.jit(lambda x: x, max_traces=0)


# -- 3. arguments -----------------------------------------------------------------------


def test_positional_keyword_default_and_nested_arguments() -> None:
    def f(
        fields: Fields, state: State, coeffs: dict[str, Any], *, dt: float = 0.5
    ) -> dict[str, Any]:
        u = fields.u + dt * fields.v * coeffs["a"][0] + state.u
        return {"u": u, "parts": [u * 2, (u.sum(), "ok")], "state": State(u, state.time + dt)}

    step = ptj.jit(f)
    args = (
        Fields(torch.randn(3), torch.randn(3)),
        State(torch.randn(3), 1.0),
        {"a": (torch.randn(3),)},
    )
    want = f(*args, dt=0.25)
    for _ in range(2):
        got = step(*args, dt=0.25)
        assert torch.allclose(got["u"], want["u"]) and torch.allclose(
            got["parts"][0], want["parts"][0]
        )
        assert got["parts"][1][1] == "ok" and isinstance(got["parts"][1], tuple)
        assert isinstance(got["state"], State) and got["state"].time == 1.25
    step(*args)  # the default dt is a different static value
    assert step.num_traces == 2


def test_function_without_tensor_inputs_or_outputs() -> None:
    step = ptj.jit(lambda n: (torch.arange(n) * 2, n))
    out, n = step(4)
    assert torch.equal(out, torch.arange(4) * 2) and n == 4
    assert torch.equal(step(4)[0], out)
    nothing = ptj.jit(lambda x: None)
    assert nothing(torch.ones(1)) is None and nothing(torch.ones(1)) is None


# -- 4. modules -------------------------------------------------------------------------


def test_parameters_stay_live_and_optimizer_steps_are_seen() -> None:
    net = Source(4)
    step = ptj.jit(lambda u: net(u).pow(2).sum())
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    u = torch.randn(4)
    for _ in range(3):
        opt.zero_grad()
        loss = step(u)
        loss.backward()
        eager_grad = torch.autograd.grad(net(u).pow(2).sum(), net.lin.weight)[0]
        assert torch.allclose(net.lin.weight.grad, eager_grad)
        opt.step()
        assert torch.allclose(step(u), net(u).pow(2).sum())
    assert step.num_traces == 1


def test_jit_of_a_module_and_of_a_forward_method() -> None:
    net = Source(4)
    jitted = ptj.jit(net)
    u = torch.randn(4)
    assert torch.allclose(jitted(u), net(u)) and torch.allclose(jitted(u), net(u))

    class Stepper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = Source(4)
            self.calls = 0

        @ptj.jit(side_effects="trace")  # counts its passes: JAX's rule
        def forward(self, u: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return u + self.net(u)

    a, b = Stepper(), Stepper()
    for _ in range(3):
        assert torch.allclose(a(u), u + a.net(u))
        assert torch.allclose(b(u), u + b.net(u))  # another instance: its own specialization
    assert a.calls == 2 and b.calls == 2  # record + trace; compiled calls run no Python
    a(u).sum().backward()
    assert a.net.lin.weight.grad is not None
    assert Stepper.forward.num_traces == 2


def test_module_passed_as_argument() -> None:
    step = ptj.jit(lambda net, u: net(u) * 2)
    n1, n2 = Source(3), Source(3)
    u = torch.randn(3)
    assert torch.allclose(step(n1, u), n1(u) * 2)
    assert torch.allclose(step(n2, u), n2(u) * 2)
    assert torch.allclose(step(n1, u), n1(u) * 2)
    assert step.num_traces == 2


# -- 5. custom functions (see also test_custom_op / test_backward) -----------------------


@pytest.mark.torchscript_bodies
def test_custom_forward_python_does_not_run_after_first_call() -> None:
    counter = Counter()

    def prefix(x: torch.Tensor) -> torch.Tensor:
        counter.forward += 1
        return x.cumsum(0)

    f = ptj.custom_gradient(prefix, lambda i, o, g: (g[0].flip(0).cumsum(0).flip(0),))
    step = ptj.jit(lambda x: f(x) * 2, fallback="off")  # the meter's eager calls run it
    x = torch.randn(5)
    step(x)
    before = counter.forward
    for _ in range(3):
        step(x)
    assert counter.forward == before


# -- 6. no silent baking -----------------------------------------------------------------


def test_fluid_at_rest_is_not_nan() -> None:
    solve = make_solve()
    step = ptj.jit(lambda b, k: solve(b, k))
    k = torch.tensor(0.5)
    step(torch.randn(32), k)
    rest = step(torch.zeros(32), k)
    assert not torch.isnan(rest).any() and torch.equal(rest, torch.zeros(32))
    hard = torch.randn(32) * 100
    assert torch.allclose(step(hard, k), cg_loop(hard, k), rtol=1e-4, atol=1e-3)


# -- 7. nested jit -----------------------------------------------------------------------


def test_nested_jit_is_inlined_and_keeps_its_own_cache() -> None:
    counter = Counter()

    @ptj.jit
    def inner(x: torch.Tensor) -> torch.Tensor:
        counter.forward += 1
        return x.sin()

    @ptj.jit
    def outer(x: torch.Tensor) -> torch.Tensor:
        return inner(x) * 2

    x = torch.randn(3)
    outer(x)
    assert inner.num_traces == 0  # inlined: no trace of its own
    before = counter.forward
    assert torch.allclose(outer(x), x.sin() * 2)
    assert counter.forward == before
    assert torch.allclose(inner(x), x.sin()) and inner.num_traces == 1


# -- 8. side effects once ----------------------------------------------------------------


def test_batchnorm_stats_and_rng_advance_as_one_eager_call() -> None:
    def make() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))

    x = torch.randn(8, 4)
    eager_net, jit_net = make(), make()
    torch.manual_seed(2)
    want = eager_net(x)
    want_next = torch.rand(3)
    torch.manual_seed(2)
    got = ptj.jit(jit_net)(x)
    got_next = torch.rand(3)
    assert torch.allclose(got, want)
    assert torch.equal(got_next, want_next)  # the RNG advanced exactly as by one eager call
    bn_e, bn_j = eager_net[1], jit_net[1]
    assert int(bn_j.num_batches_tracked) == 1
    assert torch.allclose(bn_j.running_mean, bn_e.running_mean)
    assert torch.allclose(bn_j.running_var, bn_e.running_var)
    assert bn_j.running_mean._version == bn_e.running_mean._version  # the trace left no write


def test_first_call_result_is_differentiable_with_batchnorm_in_training() -> None:
    # BatchNorm's autograd saves its running stats; the trace pass must not look like a write
    # to them (found by the compile engine's training test: backward raised "modified by an
    # inplace operation").
    torch.manual_seed(3)
    nets = [nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    x = torch.randn(8, 4)
    step = ptj.jit(lambda net, x: (net(x) ** 2).sum())
    for _ in range(2):  # the record call, then a compiled call
        got = torch.autograd.grad(step(nets[0], x), list(nets[0].parameters()))
        want = torch.autograd.grad((nets[1](x) ** 2).sum(), list(nets[1].parameters()))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)


def test_input_modified_in_place_once() -> None:
    def bump(x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return x * 2

    step = ptj.jit(bump)
    x = torch.zeros(2)
    step(x)
    assert torch.equal(x, torch.ones(2))
    step(x)
    assert torch.equal(x, torch.full((2,), 2.0))


# -- 9. state and failures ---------------------------------------------------------------


def test_user_exception_reaches_caller_unchanged_and_leaves_no_state() -> None:
    class Boom(Exception):
        pass

    fail = {"record": True}

    def f(x: torch.Tensor) -> torch.Tensor:
        if fail["record"]:
            raise Boom("from user code")
        return x + 1

    step = ptj.jit(f)
    hooks = len(nn.modules.module._global_forward_pre_hooks)
    with pytest.raises(Boom, match="from user code") as info:
        step(torch.ones(1))
    frames = [fr.name for fr in traceback.extract_tb(info.value.__traceback__)]
    assert frames[-1] == "f"
    assert current_frame() is None and step.num_traces == 0
    assert len(nn.modules.module._global_forward_pre_hooks) == hooks
    fail["record"] = False
    assert torch.equal(step(torch.ones(1)), torch.full((1,), 2.0))


def test_exception_while_tracing_runs_eagerly_with_one_warning() -> None:
    """NOTE [eager, never a crash]: the record pass succeeded, so a failing trace pass is not
    the caller's error: the call returns the record pass's result, later calls run eagerly."""
    runs = Counter()

    def f(x: torch.Tensor) -> torch.Tensor:
        runs.forward += 1
        if runs.forward == 2:  # the trace pass
            raise KeyError("during trace")
        return x * 3

    step = ptj.jit(f, side_effects="trace")  # counts its passes
    with pytest.warns(ptj.JitWarning, match="could not trace it: KeyError: 'during trace'"):
        assert torch.equal(step(torch.ones(1)), torch.full((1,), 3.0))
    assert current_frame() is None
    assert torch.equal(step(torch.ones(1)), torch.full((1,), 3.0))
    assert runs.forward == 3 and "runs eagerly" in step.explain()


def test_two_threads_jitting_at_once(device: torch.device) -> None:
    solve = make_solve()
    nets = [Source(6), Source(6)]
    steps = [ptj.jit(lambda u, k, net=net: solve(u + net(u), k)) for net in nets]
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            barrier.wait(5)
            for j in range(20):  # a thread's default device is the CPU: named
                u = torch.randn(6, device=device) + j
                k = torch.tensor(0.3, device=device)
                got = steps[i](u, k)
                want = cg_loop(u + nets[i](u), k)
                assert torch.allclose(got, want, atol=1e-4)
        except BaseException as e:  # collected and re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors

    # engine "auto" runs a new signature eagerly while another compiles on the caller's
    # thread (NOTE [one tracing thread]): on a loaded machine all 20 calls of one thread can
    # fall into the other's compile; one more call then traces it. Never twice. That call
    # runs in a thread too: the main thread's default device (CUDA under make test-cuda) is
    # another environment, a retrace of its own.
    def once_more(step: Any, net: nn.Module) -> None:
        u, k = torch.randn(6, device=device), torch.tensor(0.3, device=device)
        if not torch.allclose(step(u, k), cg_loop(u + net(u), k), atol=1e-4):
            errors.append(AssertionError("differs from eager"))

    for step, net in zip(steps, nets):
        thread = threading.Thread(target=once_more, args=(step, net))
        thread.start()
        thread.join()
    assert not errors, errors
    assert [s.num_traces for s in steps] == [1, 1]


# -- 11. introspection -------------------------------------------------------------------


@pytest.mark.torchscript_bodies
def test_explain_lists_signature_modules_custom_functions_and_times(jit_engine: str) -> None:
    solve = make_solve()
    net = Source(4)
    step = ptj.jit(lambda u, k: solve(net(u), k))
    u = torch.randn(4, requires_grad=True)
    step(u, torch.tensor(0.2))
    step(u, torch.tensor(0.2)).sum().backward()
    text = step.explain()
    assert f"engine {engine_name(jit_engine)!r}, 1 trace(s)" in text
    where = u.device
    assert (
        f"(Tensor[4] float32 {where} requires_grad, Tensor[] float32 {where}), grad enabled" in text
    )
    assert "modules: m0_Source" in text
    assert "custom function solve (" in text
    assert "forward: scripted" in text or "forward: looped" in text
    mode = value_loop_mode(step)  # the gradient's CG loop: captured, or Python
    assert f"backward for needs_input_grad=(True, False): {mode}" in text
    assert "times: record" in text and "trace" in text


def test_retraces_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    step = ptj.jit(lambda x, n: x * n)
    with caplog.at_level("INFO", logger="phi_torch_jit"):
        step(torch.ones(1), 1)
        step(torch.ones(1), 2)
    assert any("(#2): n: 1 -> 2" in r.getMessage() for r in caplog.records)


def test_trace_check_says_whether_a_call_would_find_a_program_and_runs_nothing() -> None:
    calls = Counter()

    def f(x: torch.Tensor, dt: float) -> torch.Tensor:
        calls.forward += 1
        return x * dt

    step = ptj.jit(f)
    x = torch.ones(3)
    assert step.trace_check(x, 0.1) == (False, "not yet traced")
    step(x, 0.1)
    ran = calls.forward
    assert step.trace_check(torch.zeros(3), 0.1) == (True, "")  # values are not keyed
    traced, why = step.trace_check(torch.ones(4), 0.1)
    assert not traced and why == "x: shape (3,) -> (4,)"
    traced, why = step.trace_check(x, 0.2)
    assert not traced and why == "dt: 0.1 -> 0.2"
    assert calls.forward == ran and step.num_traces == 1


class _DictBacked:
    """A configuration object whose ``__getattr__`` reads a dict: a missing name raises
    ``KeyError``, not AttributeError (as ``getattr(obj, name, default)`` expects)."""

    def __init__(self) -> None:
        self._table = {"k": 2.0}

    def __getattr__(self, name: str) -> Any:
        return self._table[name]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


@pytest.mark.all_engines
def test_a_callable_whose_getattr_raises_key_error_is_jitted() -> None:
    """``jit(obj)`` raised ``KeyError: '__qualname__'`` (naming it, ``functools.wraps``,
    ``inspect.signature``, the walk): probe 50."""
    sim = _DictBacked()
    jitted = ptj.jit(sim)
    x = torch.ones(2)
    legacy = jitted.engine.name == "torchscript"  # its trace asks for __func__: eager, warned
    with pytest.warns(ptj.JitWarning, match="KeyError") if legacy else nullcontext():
        torch.testing.assert_close(jitted(x), sim(x))
    for _ in range(2):
        torch.testing.assert_close(jitted(x), sim(x))
    assert "_DictBacked" in repr(jitted)
    sim._table["k"] = 5.0
    torch.testing.assert_close(jitted(x), sim(x))
