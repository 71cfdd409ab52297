"""Which tensors a step reads from globals and closures become inputs of its program.

A tensor reached by the walk (a global list of them, a closure) is an input only if the record
pass gave it to a torch call (a property read, ``t.shape``, counts) or returned it; the others
are guarded by identity only. Every test compares with the same code run eagerly while the
tensors are rebound, written in place or reshaped between calls.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines

BANK = [torch.full((3,), float(i)) for i in range(600)]
WHICH = 3


def _one_of_the_bank(x: torch.Tensor) -> torch.Tensor:
    return x * BANK[WHICH] + 1


def _program_inputs(jitted: ptj.JitFunction) -> list[str]:  # type: ignore[type-arg]
    return [line for line in jitted.explain().splitlines() if "input of the program" in line]


def test_of_a_global_list_of_600_tensors_only_the_one_read_is_an_input() -> None:
    """Until now the walk's first 512 tensors were inputs, their metadata guarded, 0.5-1.3 ms
    a call for a step using one; the one read is an input, and what happens to it is seen;
    the others are guarded by identity (replacing one retraces)."""
    global WHICH
    saved = list(BANK)
    jitted = ptj.jit(_one_of_the_bank)
    x = torch.ones(3)
    changes: list[Callable[[], object]] = [
        lambda: None,
        lambda: BANK.__setitem__(3, torch.full((3,), 7.0)),  # rebound: the input is fetched
        lambda: BANK[3].mul_(2),  # written in place
        lambda: BANK.__setitem__(5, torch.zeros(9)),  # another: guarded by identity only
        lambda: BANK.insert(0, torch.full((3,), -1.0)),  # its length is guarded: retraced
        lambda: BANK.__setitem__(3, torch.ones(2, 3)),  # reshaped: retraced
    ]
    try:
        for change in changes:
            change()
            torch.testing.assert_close(jitted(x), _one_of_the_bank(x))
        assert jitted.num_traces == 4
        inputs = _program_inputs(jitted)
        assert len(inputs) == 4 and all("BANK[3]" in i for i in inputs), inputs  # one each
        WHICH = 7  # another index: guarded by value, retraced, that one read
        torch.testing.assert_close(jitted(x), _one_of_the_bank(x))
        assert jitted.num_traces == 5
    finally:
        BANK[:] = saved
        WHICH = 3


G = torch.ones(3)
PAIR = [torch.ones(3), torch.ones(3)]


def _returned(x: torch.Tensor) -> torch.Tensor:
    return G


def _in_an_output(x: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"x": x + 1, "g": PAIR[1]}


def _in_a_list_argument(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, *PAIR])


def _its_shape_read(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(G.shape[0], 1) * 2


def _sliced(x: torch.Tensor) -> torch.Tensor:
    return x * G[1:].sum()


def _a_foreach_list(x: torch.Tensor) -> torch.Tensor:
    return torch._foreach_add([x, x], PAIR)[1]


@pytest.mark.parametrize(
    "step",
    [_returned, _in_an_output, _in_a_list_argument, _its_shape_read, _sliced,
     _a_foreach_list],
)  # fmt: skip
def test_a_tensor_used_by_any_route_is_an_input_never_baked(
    step: Callable[[torch.Tensor], object],
) -> None:
    """Returned, in a list a torch call takes, its shape read in Python, sliced: each is a
    use; the global rebound with new values on every call is what each call sees."""
    global G
    saved, pair = G, list(PAIR)
    jitted = ptj.jit(step)
    try:
        for i in range(4):
            G = torch.full((3,), float(i + 2))
            PAIR[:] = [G * 2, G * 3]
            x = torch.ones(3)
            expected, got = step(x), jitted(x)
            leaves = torch.utils._pytree.tree_leaves
            for e, j in zip(leaves(expected), leaves(got), strict=True):
                torch.testing.assert_close(j, e)
    finally:
        G, PAIR[:] = saved, pair


SCALE = torch.full((3,), 2.0)


class _ScaledGradient(torch.autograd.Function):
    """Forward: identity; backward: scales by the global SCALE, read in the backward only."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad * SCALE


def _scaled(x: torch.Tensor) -> torch.Tensor:
    return _ScaledGradient.apply(x).sum()  # type: ignore[no-any-return]


def test_a_tensor_read_in_a_backward_only_is_still_seen() -> None:
    """Python that runs later, in a custom function's backward, may read tensors the record
    pass never gave to a torch call: then every tensor read stays an input and guarded (a
    module's backward hooks run the step eagerly)."""
    global SCALE
    saved = SCALE
    jitted = ptj.jit(_scaled)
    try:
        for i in range(4):
            SCALE = torch.full((3,), float(i + 1))
            x, y = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
            _scaled(x).backward()
            jitted(y).backward()
            torch.testing.assert_close(y.grad, x.grad)
    finally:
        SCALE = saved


@pytest.mark.uses_torchscript
def test_a_tensor_given_to_torchscript_code_stays_an_input() -> None:
    """A TorchScript function's ops reach no torch-function mode: the record pass cannot see
    which tensors it uses, so every tensor read stays an input (a trace baked the first
    call's global, found when the pruning above was first written)."""
    global G
    with warnings.catch_warnings():  # torch 2.11+ deprecates TorchScript (a
        warnings.simplefilter("ignore")  # DeprecationWarning, from 2.15 a FutureWarning);
        scripted = torch.jit.script(_multiply)  # libraries still use it
    saved = G

    def step(x: torch.Tensor) -> torch.Tensor:
        return scripted(x, G)  # type: ignore[no-any-return]

    jitted = ptj.jit(step)
    try:
        for i in range(4):
            G = torch.full((3,), float(i + 2))
            torch.testing.assert_close(jitted(torch.ones(3)), step(torch.ones(3)))
    finally:
        G = saved


def _multiply(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * b


FLAG: Any = torch.ones(3)
A, B = torch.ones(3), torch.ones(3)
CURRENT = A


def _none_check(x: torch.Tensor) -> torch.Tensor:
    return x if FLAG is None else x * 2


def _type_check(x: torch.Tensor) -> torch.Tensor:
    return x * 3 if isinstance(FLAG, torch.nn.Parameter) else x * 2


def _identity_check(x: torch.Tensor) -> torch.Tensor:
    return x * 3 if CURRENT is A else x * 2


def _unseen_by_the_mode(x: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunction():
        return x * FLAG


def _flip() -> None:
    global FLAG, CURRENT
    FLAG = torch.nn.Parameter(torch.full((3,), 5.0)) if FLAG is None else None
    CURRENT = B


def _rebind() -> None:
    global FLAG
    FLAG = torch.full((3,), 5.0)


@pytest.mark.parametrize(
    ("step", "change"),
    [(_none_check, _flip), (_type_check, _flip), (_identity_check, _flip),
     (_unseen_by_the_mode, _rebind)],
    ids=["is None", "isinstance", "is A", "DisableTorchFunction"],
)  # fmt: skip
def test_a_tensor_no_torch_call_is_given_is_still_guarded_by_identity(
    step: Callable[[torch.Tensor], torch.Tensor], change: Callable[[], None]
) -> None:
    """Read only as an object (``G is None``, ``isinstance``, ``CUR is A``) or by code no
    torch-function mode sees: not an input, but rebinding it retraces (found by probe round
    19: left out entirely, such reads were baked)."""
    global FLAG, CURRENT
    try:
        for _ in range(2):
            jitted = ptj.jit(step)
            for _ in range(3):
                torch.testing.assert_close(jitted(torch.ones(3)), step(torch.ones(3)))
            change()
            for _ in range(2):
                torch.testing.assert_close(jitted(torch.ones(3)), step(torch.ones(3)))
    finally:
        FLAG, CURRENT = torch.ones(3), A


SCALED = torch.linspace(0.5, 1.5, 3)
SCALED.scale = 2.0  # type: ignore[attr-defined]
TAGGED = torch.nn.Parameter(torch.ones(3))
TAGGED.lr_scale = {"k": 3.0}  # type: ignore[attr-defined]


def _attributes_of_tensors(x: torch.Tensor) -> torch.Tensor:
    return x * SCALED.scale + TAGGED.lr_scale["k"] * SCALED  # type: ignore[attr-defined]


def test_python_attributes_set_on_a_tensor_read_are_guarded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``W.scale = 2.0`` on a global tensor (or a parameter's ``lr_scale`` outside a module):
    the tensor is an input of the program, and its attributes were not guarded at all: the
    first call's value was baked on every engine (guarded.md's honest list until session 29).
    A tensor's attributes are walked as an object's: plain values by value, containers by
    content, and how many there are; the trace's input standing for the tensor carries them."""
    monkeypatch.setattr(SCALED, "scale", 2.0)
    monkeypatch.setattr(TAGGED, "lr_scale", {"k": 3.0})
    jitted = ptj.jit(_attributes_of_tensors)
    x = torch.ones(3)
    changes = [
        lambda: setattr(SCALED, "scale", 5.0),
        lambda: TAGGED.lr_scale.__setitem__("k", -1.0),  # type: ignore[attr-defined]
        lambda: setattr(SCALED, "scale", 0.25),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for change in [lambda: None, *changes]:
            change()
            for _ in range(2):
                torch.testing.assert_close(jitted(x), _attributes_of_tensors(x))
    assert jitted.num_traces == 4
