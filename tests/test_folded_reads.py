"""Read-only arguments of opaque calls computed from a graph's own constants, folded once
(``engines._folded_reads``), and the solver's kept matrix forms found by those tensors'
identity (``adapters.phiml._forms.Forms``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from phi_torch_jit.engines import _opaque_calls
from phi_torch_jit.engines._folded_reads import FOLDED_PREFIX, fold_read_arguments


class _Owner:
    pass


class _Spy:
    """A solver stand-in that keeps the objects it is given as its read-only argument."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def __call__(self, matrix: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.seen.append(matrix)
        return ((matrix * b).sum().reshape(1),)


def _captured(body: Any, spy: _Spy, owner: _Owner) -> torch.fx.GraphModule:
    key = _opaque_calls.register(spy, owner, reads=1)

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _opaque_calls.call(key, (body(x), x))

    return make_fx(fn, tracing_mode="real")(torch.ones(3))


def _ops(graph: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]


def test_a_read_argument_made_from_fresh_constants_is_computed_once_and_passed_as_one_object(
) -> None:  # fmt: skip
    owner, spy = _Owner(), _Spy()

    def matrix(x: torch.Tensor) -> torch.Tensor:
        values = torch.tensor([[1.0, 2.0, 3.0, 4.0]])  # made by the captured code: fresh
        return values[0].index_select(0, torch.tensor([0, 2, 3])) * 2.0

    graph = _captured(matrix, spy, owner)
    x = torch.tensor([1.0, -1.0, 0.5])
    (want,) = graph(x)
    assert fold_read_arguments(graph) == 1
    assert "aten.lift_fresh_copy.default" not in _ops(graph)  # what computed it is gone
    assert "aten.index_select.default" not in _ops(graph)
    spy.seen.clear()
    for _ in range(3):
        (got,) = graph(x)
        assert torch.equal(got, want)
    assert all(t is spy.seen[0] for t in spy.seen)  # the same object on every call
    assert torch.equal(spy.seen[0], torch.tensor([2.0, 6.0, 8.0]))
    assert [n for n, _ in graph.named_buffers() if n.startswith(FOLDED_PREFIX)] == [
        f"{FOLDED_PREFIX}0"
    ]


@pytest.mark.parametrize("kind", ["input", "written", "random", "not read only"])
def test_what_may_differ_between_calls_is_not_folded(kind: str) -> None:
    owner, spy = _Owner(), _Spy()

    def from_input(x: torch.Tensor) -> torch.Tensor:
        return torch.tensor([1.0, 2.0, 3.0]) * x

    def written(x: torch.Tensor) -> torch.Tensor:
        values = torch.tensor([1.0, 2.0, 3.0])
        values.mul_(2.0)  # an op of the graph writes it
        return values

    def random(x: torch.Tensor) -> torch.Tensor:
        return torch.rand(3)

    bodies = {"input": from_input, "written": written, "random": random}
    if kind == "not read only":  # registered without reads: the op may write it
        key = _opaque_calls.register(spy, owner)
        graph = make_fx(
            lambda x: _opaque_calls.call(key, (torch.tensor([1.0, 2.0, 3.0]) + 1.0, x)),
            tracing_mode="real",
        )(torch.ones(3))
    else:
        graph = _captured(bodies[kind], spy, owner)
    before = _ops(graph)
    assert fold_read_arguments(graph) == 0
    assert _ops(graph) == before


def _csr(values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    crow = torch.tensor([0, 2, 3, 5])
    col = torch.tensor([0, 1, 1, 0, 2])
    return crow, col, values


@pytest.mark.filterwarnings("ignore::UserWarning")  # sparse CSR: beta, invariants unchecked
def test_a_kept_form_is_found_by_its_parts_identity_until_one_is_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("phiml")
    from phi_torch_jit.adapters.phiml import _forms as _cg

    compared = []
    matches = _cg._Form.matches

    def counted(self: Any, *args: Any) -> bool:
        compared.append(1)
        return matches(self, *args)

    monkeypatch.setattr(_cg._Form, "matches", counted)
    forms = _cg.Forms()
    parts = _csr(torch.tensor([4.0, -1.0, 4.0, -1.0, 4.0]))
    first = forms.form_of(torch.sparse_csr_tensor(*parts, (3, 3)), parts)
    for _ in range(3):  # a new matrix over the same parts: no bitwise comparison
        assert forms.form_of(torch.sparse_csr_tensor(*parts, (3, 3)), parts) is first
    assert compared == []
    parts[2].mul_(2.0)  # written in place: compared, and built anew
    changed = forms.form_of(torch.sparse_csr_tensor(*parts, (3, 3)), parts)
    assert compared and changed is not first
    want = _cg.product_form(torch.sparse_csr_tensor(*parts, (3, 3)))
    assert all(torch.equal(a, b) for a, b in zip(changed, want))
    equal = _csr(parts[2].clone())  # other objects with equal bits: found by comparison
    assert forms.form_of(torch.sparse_csr_tensor(*equal, (3, 3)), equal) is changed
