"""Custom-function bodies captured as graphs run straight-line (engines/_graph_bodies.py): the
bodies of engine "auto", the default, which runs no TorchScript."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import Counter

import phi_torch_jit as ptj
from phi_torch_jit.engines._graph_bodies import GraphBodies, capture_body


def _auto(fn: object) -> ptj.JitFunction:
    return ptj.jit(fn, engine="auto", backend="aot_eager", compile_on="caller")


def test_a_body_is_captured_and_runs_its_graph() -> None:
    counter = Counter()

    def forward(x: torch.Tensor) -> torch.Tensor:
        counter.forward += 1
        return torch.sin(x) * 2 + x

    def gradient(inputs: object, outputs: object, grads: tuple[torch.Tensor]) -> torch.Tensor:
        counter.gradient += 1
        (x,) = inputs  # type: ignore[misc]
        return grads[0] * (2 * torch.cos(x) + 1)

    f = ptj.custom_gradient(forward, gradient)
    step = _auto(lambda x: f(x) * 3)
    x = torch.randn(5, requires_grad=True)
    for _ in range(4):
        (got,) = torch.autograd.grad(step(x).sum(), x)
        torch.testing.assert_close(got, 3 * (2 * torch.cos(x) + 1))
    (call,) = step.specializations[0].calls
    assert call.forward.mode == "traced"
    assert call.backward.specializations[(True,)].mode == "traced"
    # Python: the record pass, the capture; the gradient: the record pass's eager backward,
    # its capture, the op's run on zeros (learning which gradients are None)
    assert counter.forward == 2 and counter.gradient == 3


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (lambda x: x * sum(x.tolist()), "Tensor.tolist"),
        (lambda x: x * float(x.numpy().sum()), "Tensor.numpy"),
        (lambda x: x * 2 if x.sum() > 0 else x, "capture failed"),
        (lambda x: x[x > 0].sum() * x, "depends on tensor values"),
    ],
)
def test_a_body_that_reads_values_is_not_captured(body: object, reason: str) -> None:
    x = torch.tensor([1.0, -2.0, 3.0])
    captured = capture_body(body, (x,))  # type: ignore[arg-type]
    assert isinstance(captured, str) and reason in captured
    assert x.tolist() == [1.0, -2.0, 3.0]  # reads work again after the capture


def test_a_backward_compiled_while_the_lock_is_taken_does_not_wait() -> None:
    """Engine "auto"'s background compile holds the tracing lock for up to minutes; the first
    backward (which compiles the custom backward) waited for it (a training step's second call
    took 78 s; then 67 s, its gradient's own custom call compiling as a nested call). It runs
    as Python instead, nested calls eagerly, and the next backward compiles."""
    counter = Counter()
    double = ptj.custom_gradient(lambda g: g * 2, lambda i, o, g: (g[0] * 2,))

    def gradient(inputs: object, outputs: object, grads: tuple[torch.Tensor]) -> torch.Tensor:
        counter.gradient += 1
        return double(grads[0])  # a custom function inside the gradient (an adjoint solve)

    f = ptj.custom_gradient(lambda x: x * 2, gradient)
    step = _auto(lambda x: f(x).sin())
    x = torch.randn(4, requires_grad=True)
    step(x)
    functions = step.engine.functions
    assert isinstance(functions, GraphBodies)
    taken, done = threading.Event(), threading.Event()

    def hold() -> None:
        with functions.lock:
            taken.set()
            done.wait(timeout=120)  # a hang detector: set as soon as the backward returned

    holder = threading.Thread(target=hold)
    holder.start()
    assert taken.wait(timeout=300)
    try:
        (got,) = torch.autograd.grad(step(x).sum(), x)
        assert holder.is_alive()  # returned while the lock was held: it did not wait for it
    finally:
        done.set()
        holder.join()
    torch.testing.assert_close(got, torch.cos(x * 2) * 2)
    (call,) = step.specializations[0].calls
    assert (True,) not in call.backward.specializations  # ran as Python, compiled next time
    torch.autograd.grad(step(x).sum(), x)  # the lock is free: compiled at this backward
    assert call.backward.specializations[(True,)].mode == "traced"
    before = counter.gradient
    for _ in range(3):  # then the graph serves: the gradient's Python no longer runs
        (got,) = torch.autograd.grad(step(x).sum(), x)
        torch.testing.assert_close(got, torch.cos(x * 2) * 2)
    assert counter.gradient == before
