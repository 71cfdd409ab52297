"""A Python callable as one op of a captured graph (``engines._opaque_calls``): one node under
``make_fx``, run on copies of its inputs, released with its owner."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from phi_torch_jit.engines import _opaque_calls


class _Owner:
    pass


def test_an_opaque_call_is_one_op_runs_on_copies_and_is_released_with_its_owner() -> None:
    owner = _Owner()
    runs = []

    def solver(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        runs.append(1)
        a.add_(1.0)  # writes its argument, as a CG writes its initial guess
        return a, torch.sin(a) * b

    key = _opaque_calls.register(solver, owner)
    graph = make_fx(lambda x, y: _opaque_calls.call(key, (x * 2.0, y)), tracing_mode="real")(
        torch.ones(3), torch.ones(3)
    )
    ops = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    assert ops.count(torch.ops.phi_torch_jit.opaque_call.default) == 1
    assert torch.ops.aten.sin.default not in ops  # the callable's own ops are not in the graph
    x, y = torch.ones(3), torch.full((3,), 2.0)
    first, second = graph(x, y)
    assert torch.equal(first, torch.full((3,), 3.0))
    assert torch.allclose(second, torch.sin(torch.full((3,), 3.0)) * 2.0)
    assert torch.equal(x, torch.ones(3)) and torch.equal(y, torch.full((3,), 2.0))
    assert len(runs) == 2  # the capture ran it on its real inputs, then the call
    del owner
    gc.collect()
    with pytest.raises(RuntimeError, match="released with its owner"):
        graph(x, y)


def test_arguments_registered_as_only_read_are_passed_as_they_are() -> None:
    owner = _Owner()
    addresses = []

    def solver(matrix: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        addresses.append((matrix.data_ptr(), b.data_ptr()))
        return matrix, matrix @ b  # the first output is the argument: returned as a copy

    key = _opaque_calls.register(solver, owner, reads=1)
    matrix, b = torch.eye(3), torch.ones(3)
    same, product = _opaque_calls.call(key, (matrix, b))
    assert addresses == [(matrix.data_ptr(), addresses[0][1])]
    assert addresses[0][1] != b.data_ptr()  # the other argument: a copy
    assert torch.equal(same, matrix) and same.data_ptr() != matrix.data_ptr()
    assert torch.equal(product, b)


def test_keys_of_a_capture_are_released_unless_kept_by_its_program() -> None:
    """A capture's ops (``collected``): released when the capture ends, unless ``keep`` gave
    them to the captured program, then released with it."""
    owner, program = _Owner(), _Owner()

    def solver(a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (a * 2.0,)

    with _opaque_calls.collected() as dropped:
        key = _opaque_calls.register(solver, owner)
    assert dropped == [key]
    with pytest.raises(RuntimeError, match="released"):
        _opaque_calls.call(key, (torch.ones(2),))
    with _opaque_calls.collected() as kept:
        key = _opaque_calls.register(solver, owner)
        _opaque_calls.keep(kept, program)
    assert torch.equal(_opaque_calls.call(key, (torch.ones(2),))[0], torch.full((2,), 2.0))
    del program
    gc.collect()
    with pytest.raises(RuntimeError, match="released"):
        _opaque_calls.call(key, (torch.ones(2),))
