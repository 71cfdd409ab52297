"""Stage 2: recorded custom calls compiled once and replayed as opaque ops."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from helpers import Counter, captures_graph, cg_loop, gradcheck, make_solve, value_loop_mode
from torch.profiler import ProfilerActivity, profile

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines


def _op_count(fn: Any, name: str) -> int:
    with profile(activities=[ProfilerActivity.CPU], acc_events=True) as prof:  # 2.11 warns without
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == name)


@pytest.mark.torchscript_bodies
def test_compiled_forward_runs_its_ops_once_and_no_python() -> None:
    counter = Counter()

    def prefix(x: torch.Tensor) -> torch.Tensor:
        counter.forward += 1
        return torch.cumsum(x, 0) * 2

    f = ptj.custom_gradient(
        prefix, lambda i, o, g: (torch.flip(torch.cumsum(torch.flip(2 * g[0], [0]), 0), [0]),)
    )
    step = ptj.jit(lambda x: f(x + 1).sin())
    x = torch.randn(6)
    first = step(x)
    assert counter.forward == 2  # the record pass, and tracing the forward once
    assert _op_count(lambda: step(x), "aten::cumsum") == 1
    assert counter.forward == 2  # compiled calls run no Python of the custom forward
    assert torch.allclose(step(x), first)
    assert _op_count(lambda: prefix(x), "aten::cumsum") == 1  # sanity: the profiler sees it


def _assert_the_loop_is_not_baked() -> None:
    solve = make_solve(scriptable=True)
    step = ptj.jit(lambda b, k: solve(b, k))
    k = torch.tensor(0.5)
    step(torch.randn(16), k)
    (call,) = step.specializations[0].calls
    # engines compile and auto capture the loop as compiled blocks (tests/test_loops.py)
    assert call.forward.mode in ("scripted", "looped")
    if call.forward.mode == "scripted":
        assert "control flow depends on tensor values" in call.forward.reason
    at_rest = step(torch.zeros(16), k)  # a traced CG gives NaN here
    assert torch.equal(at_rest, torch.zeros(16))
    new = torch.randn(16) * 10
    assert torch.allclose(step(new, k), cg_loop(new, k), atol=1e-5)
    assert step.num_traces == 1


@pytest.mark.torchscript_bodies
def test_data_dependent_loop_is_scripted_not_baked() -> None:
    _assert_the_loop_is_not_baked()


def test_data_dependent_loop_is_not_baked_under_a_default_device() -> None:
    """``torch.set_default_device``/``with torch.device(...)`` is a torch-function mode that
    calls each op from torch's own frame: a tracer warning raised by the loop's ``bool(rs >
    tol)`` came out attributed to torch, was taken for torch's own check, and the CG was traced
    with a fixed iteration count (NaN or nonzero at rest; found on a GPU). The warning is now
    placed at the line that called the op."""
    with torch.device("cpu"):
        _assert_the_loop_is_not_baked()


def test_warnings_under_a_default_device_are_placed_at_the_calling_line() -> None:
    import inspect

    from phi_torch_jit.engines.torchscript import _caught_warnings

    with torch.device("cpu"), _caught_warnings() as caught:
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        torch.tensor(torch.ones(1))  # torch warns in C++: copy-construct from a tensor
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)]


def test_unscriptable_loop_runs_as_python_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    counter = Counter()
    solve = make_solve(counter, scriptable=False)
    step = ptj.jit(lambda b, k: solve(b, k))
    k = torch.tensor(0.5)
    with caplog.at_level(logging.WARNING, logger="phi_torch_jit"):
        step(torch.randn(16), k)
        step(torch.randn(16), k)
    messages = [r.getMessage() for r in caplog.records if "runs as Python" in r.getMessage()]
    mode = value_loop_mode(step)  # looped: the loop in the function it calls is captured
    assert len(messages) == (1 if mode == "python" else 0)
    assert all("forward of solve" in m for m in messages)
    assert torch.equal(step(torch.zeros(16), k), torch.zeros(16))
    assert f"forward: {mode}" in step.explain()


@pytest.mark.torchscript_bodies
def test_identical_calls_share_one_compiled_op() -> None:
    counter = Counter()
    solve = make_solve(counter)

    @ptj.jit
    def four_steps(u: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            u = solve(u, k)
        return u

    u, k = torch.randn(8), torch.tensor(0.2)
    out = four_steps(u, k)
    (call,) = four_steps.specializations[0].calls
    assert call.forward.mode in ("scripted", "looped")
    assert torch.allclose(four_steps(u, k), out)


def test_forward_returning_its_input_is_safe() -> None:
    ident = ptj.custom_gradient(lambda x: x, lambda i, o, g: (g[0],))
    step = ptj.jit(lambda x: ident(x) * 2)
    x = torch.randn(3, requires_grad=True)
    step(x)
    out = step(x)
    out.sum().backward()
    assert torch.equal(out, x * 2) and torch.equal(x.grad, torch.full((3,), 2.0))


class _Shared(torch.autograd.Function):
    """Returns one tensor twice and a detached alias of its input; its backward hands both
    inputs the same gradient: outputs that alias each other and the inputs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        total = x + y
        return total, total, x.detach()

    @staticmethod
    def backward(ctx: Any, g1: torch.Tensor, g2: torch.Tensor, g3: torch.Tensor) -> Any:
        shared = g1 + g2 + g3
        return shared, shared


def test_outputs_that_alias_each_other_or_the_inputs_are_copied() -> None:
    """torch checks that a custom op's outputs alias nothing when a compiled program runs: a
    RuntimeError where the environment variable CI is set (so set here), a deprecation warning
    elsewhere. PhiML's captured CG returned such outputs and a PhiFlow step's inductor program
    failed under CI; the same for a backward returning one gradient for two inputs."""
    import torch._functorch.config as functorch_config

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a, b, c = _Shared.apply(x * 2, y)
        return a * b + c

    x, y = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    jitted = ptj.jit(step)
    with functorch_config.patch(error_on_custom_op_aliasing=True):
        for _ in range(4):
            got, want = jitted(x, y), step(x, y)
            torch.testing.assert_close(got, want)
            grads = torch.autograd.grad(got.sum(), (x, y))
            torch.testing.assert_close(grads, torch.autograd.grad(want.sum(), (x, y)))
    assert "runs eagerly" not in jitted.explain() and "failed" not in jitted.explain()


@pytest.mark.torchscript_bodies
def test_adjoint_solve_inside_gradient_is_compiled_as_nested_op(jit_engine: str) -> None:
    counter = Counter()
    solve = make_solve(counter, adjoint_via_solve=True)
    step = ptj.jit(lambda b, k: solve(b, k) * 2, fallback="off")  # counts the compiled path
    b = torch.randn(12, dtype=torch.float64, requires_grad=True)
    k = torch.tensor(0.6, dtype=torch.float64, requires_grad=True)
    want = torch.autograd.grad((solve(b, k) * 2).sum(), [b, k])
    gradients_before = counter.gradient
    step(b, k)
    for _ in range(3):
        got = torch.autograd.grad(step(b, k).sum(), [b, k])
        assert all(torch.allclose(g, w) for g, w in zip(got, want))
    # Python ran once, to build the backward; engines that capture a graph run it once more,
    # on zeros, when compiling the backward op (docs/engines.md)
    assert counter.gradient == gradients_before + (2 if captures_graph(jit_engine) else 1)
    (call,) = step.specializations[0].calls
    assert call.backward.specializations[(True, True)].mode == "traced"
    (adjoint,) = call.nested.calls.values()
    assert adjoint.forward.mode in ("scripted", "looped") and adjoint.function is solve
    assert torch.equal(step(torch.zeros_like(b), k), torch.zeros_like(b))
    assert gradcheck(step, (b, k))


def test_replay_outputs_do_not_leak_to_other_threads() -> None:
    import threading

    from phi_torch_jit._context import Replaying, call_state

    double = ptj.custom_gradient(lambda x: x * 2, lambda i, o, g: (g[0] * 2,))
    step = ptj.jit(lambda x: double(x) + 1)
    x = torch.ones(3)
    step(x)
    (call,) = step.specializations[0].calls
    seen: list[torch.Tensor] = []
    state = call_state()
    state.replaying = Replaying(call, (torch.full((3,), -7.0),), None)  # as if this thread traced
    try:
        assert torch.equal(call.op(x), torch.full((3,), -7.0))
        worker = threading.Thread(target=lambda: seen.append(step(x)))
        worker.start()
        worker.join()
    finally:
        state.replaying = None
    assert torch.equal(seen[0], torch.full((3,), 3.0))


def test_per_call_closure_argument_runs_eagerly_instead_of_going_stale(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def apply_op(op: Any, b: torch.Tensor) -> torch.Tensor:
        return op(b)

    apply = ptj.custom_gradient(apply_op, lambda i, o, g: (None, g[0]))

    @ptj.jit
    def step(b: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return apply(lambda x: x * k, b)  # a new closure over k on every call

    b = torch.ones(3)
    with caplog.at_level(logging.WARNING, logger="phi_torch_jit"):
        with pytest.warns(ptj.JitWarning, match="new function object on every call"):
            assert torch.equal(step(b, torch.tensor(2.0)), torch.full((3,), 2.0))
        assert torch.equal(step(b, torch.tensor(5.0)), torch.full((3,), 5.0))  # not stale
    assert any("new function object on every call" in r.getMessage() for r in caplog.records)
    assert step.specializations[0].eager_reason


def test_exception_in_python_forward_of_compiled_call_keeps_its_type() -> None:
    class Diverged(ArithmeticError):
        pass

    counter = Counter()

    def checked_solve(b: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        counter.forward += 1  # Python state: not scriptable, so it runs as Python
        if torch.isnan(b).any():
            raise Diverged("NaN in the right-hand side")
        return cg_loop(b, k)

    solve = ptj.custom_gradient(checked_solve, lambda i, o, g: (g[0], None))
    step = ptj.jit(lambda b, k: solve(b, k) + 1)
    k = torch.tensor(0.2)
    step(torch.ones(4), k)
    assert step.specializations[0].calls[0].forward.mode == value_loop_mode(step)
    with pytest.raises(Diverged, match="NaN in the right-hand side") as info:
        step(torch.full((4,), float("nan")), k)
    assert info.traceback[-1].name == "checked_solve"
    assert torch.allclose(step(torch.ones(4), k), cg_loop(torch.ones(4), k) + 1)


_LOGGED = Counter()  # forward: runs; gradient: the sum of what the runs saw


class _Logged(torch.autograd.Function):
    """A forward whose Python runs on every call (it reads values with ``.tolist()``) and
    leaves a trace outside the program: how often it ran and what it saw."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        _LOGGED.forward += 1
        _LOGGED.gradient += int(sum(x.tolist()))
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


def test_a_custom_call_whose_result_is_unused_still_runs_as_eagerly() -> None:
    """A dead custom call (PhiFlow's second pressure solve when the loss reads only the smoke
    the first one moved) was dropped by the backend: its SolveTape entry and its convergence
    check were missing on every compiled call. One that runs Python, or a library's checks,
    runs on every call, used or not, as eagerly."""

    def step(x: torch.Tensor) -> torch.Tensor:
        _Logged.apply(x + 1)  # result unused
        return x.sin()

    jitted = ptj.jit(step, fallback="off")
    inputs = [torch.full((3,), float(i)) for i in range(4)]
    jitted(inputs[0])
    jitted(inputs[0])
    jitted.wait_compiled()  # the compiled program serves from here on
    runs, seen = _LOGGED.forward, _LOGGED.gradient
    for x in inputs:
        torch.testing.assert_close(jitted(x), x.sin())
    assert _LOGGED.forward - runs == len(inputs)
    assert _LOGGED.gradient - seen == sum(3 * (i + 1) for i in range(4))
    assert jitted.num_traces == 1


class _NamedApart(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 3.0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 3.0


def test_an_ops_name_does_not_depend_on_what_was_jitted_before_it() -> None:
    """Inductor keys a compiled graph by its text, which names each custom call's op: a
    counter over the process gave a second PhiFlow simulation's solve another name when
    another ran before it, and no warm start. The name is the function's and a hash of its
    contract; only a second op of the same stem in a process is numbered."""
    import re

    def names(n: int) -> list[str]:
        step = ptj.jit(lambda x: _NamedApart.apply(x))
        step(torch.ones(n))
        return [call.op_name for s in step.specializations for call in s.calls]

    before = ptj.jit(lambda x: (x * 2.0).sin())  # another function's capture first
    before(torch.ones(2))
    pattern = r"NamedApart_([0-9a-f]{8})(?:_(\d+))?"  # numbered by the earlier engines' runs
    (first,) = names(7)
    (other,) = names(8)  # another contract: another hash
    (again,) = names(7)  # the same contract again in this process: the next number
    one, two, three = (re.fullmatch(pattern, n) for n in (first, other, again))
    assert one and two and three, (first, other, again)
    assert one[1] == three[1] != two[1]
    assert int(three[2]) == int(one[2] or 0) + 1
