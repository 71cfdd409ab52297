"""Stage 1 (record), the watch on parameter state the step writes (``_param_writes``,
``_unguardable``): a parameter written in place is written once per call, as in eager; ``.grad``
read or written and ``requires_grad`` of parameters changed inside the step run eagerly, warned.

Each case was found silently wrong by a probe (round 10): the trace pass and the warm-up run
wrote parameters a second and third time on the first call of every specialization; a
compiled program kept the first call's ``.grad`` and skipped ``zero_grad``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def _calls(
    make: Callable[[nn.Module], Callable[[torch.Tensor], torch.Tensor]], n: int = 4
) -> tuple[list[str], nn.Module]:
    """Run ``make(model)`` eagerly and jitted on copies of one model, ``n`` calls each with new
    inputs and a backward outside; outputs, parameters and their gradients equal after every
    call. Returns the JitWarnings and the jitted model."""
    mine, theirs = _model(), _model()
    jitted, eager = ptj.jit(make(mine)), make(theirs)
    caught: list[str] = []
    for i in range(n):
        x = torch.linspace(-1, 1, 6, dtype=torch.float64).reshape(2, 3) * (i + 1)
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always", ptj.JitWarning)
            got = jitted(x)
        caught += [str(w.message) for w in warned]
        want = eager(x)
        torch.testing.assert_close(got, want)
        assert got.requires_grad == want.requires_grad
        if want.requires_grad:
            got.sum().backward()
            want.sum().backward()
        for a, b in zip(mine.parameters(), theirs.parameters()):
            torch.testing.assert_close(a, b)
            assert (a.grad is None) == (b.grad is None)
            if a.grad is not None:
                torch.testing.assert_close(a.grad, b.grad)
    return caught, mine


WRITES: dict[str, Callable[[nn.Module], None]] = {
    "add_ under no_grad": lambda m: m[0].bias.add_(0.5),
    "an item assigned": lambda m: m[0].bias.__setitem__(0, m[0].bias[0] + 1.0),
    "+=": lambda m: m[2].bias.__iadd__(1.0),
    "a foreach update": lambda m: torch._foreach_add_(list(m.parameters()), 0.25),
    "out=": lambda m: torch.add(m[2].bias, 1.0, out=m[2].bias),
    "a row through a view": lambda m: m[0].weight[0].mul_(2.0),
    "a transposed view": lambda m: m[0].weight.T.add_(0.1),
}


@pytest.mark.parametrize("write", list(WRITES))
def test_a_parameter_written_in_place_is_written_once_per_call(write: str) -> None:
    """The parameters after each call equal eager's: the trace is rewound past the write, the
    record pass's value put back after it (no copy of parameters that are not written)."""

    def make(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        def step(x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                WRITES[write](model)
            return model(x)

        return step

    _calls(make)


def test_a_hand_written_sgd_step_with_gradients_inside_updates_once_per_call() -> None:
    """``autograd.grad`` inside the step, then ``p.sub_(lr * g)`` under ``no_grad``: the loss
    and the parameters follow eager's, call after call."""

    def make(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        def step(x: torch.Tensor) -> torch.Tensor:
            loss = (model(x) ** 2).mean()
            grads = torch.autograd.grad(loss, list(model.parameters()))
            with torch.no_grad():
                for p, g in zip(model.parameters(), grads):
                    p.sub_(0.1 * g)
            return loss.detach()

        return step

    _calls(make)


GRAD_STATE: dict[str, Callable[[nn.Module], Callable[[torch.Tensor], torch.Tensor]]] = {
    "zero_grad inside": lambda m: lambda x: (m.zero_grad(), m(x))[1],
    "set_to_none=False": lambda m: lambda x: (m.zero_grad(set_to_none=False), m(x))[1],
    "reading .grad": lambda m: lambda x: m(x) * (0.0 if m[0].bias.grad is None else 1.0),
    ".grad assigned": lambda m: lambda x: (setattr(m[2].bias, "grad", None), m(x))[1],
    "requires_grad_ toggled": lambda m: lambda x: _frozen_first_layer(m, x),
    "vector_to_parameters": lambda m: lambda x: _scaled_parameters(m, x),
    "set_": lambda m: lambda x: _set_bias(m, x),
}


def _scaled_parameters(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """torch's own helper assigns ``param.data``: a swap a trace does not follow."""
    with torch.no_grad():
        flat = nn.utils.parameters_to_vector(model.parameters())
        nn.utils.vector_to_parameters(0.9 * flat, model.parameters())
    return model(x)


def _set_bias(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        model[2].bias.set_(0.9 * model[2].bias)
    return model(x)


def _frozen_first_layer(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    for p in model[0].parameters():
        p.requires_grad_(False)
    hidden = model[0](x)
    for p in model[0].parameters():
        p.requires_grad_(True)
    return model[2](torch.tanh(hidden))


@pytest.mark.parametrize("case", list(GRAD_STATE))
def test_grad_state_read_or_written_inside_the_step_runs_eagerly_warned(case: str) -> None:
    """``zero_grad()`` inside a jitted loss (its backward outside) was skipped by compiled
    calls (gradients piled up); ``.grad`` read was baked; a parameter frozen around a layer
    got a gradient. Eager, one warning naming the read."""
    caught, _ = _calls(GRAD_STATE[case])
    assert any("runs eagerly" in w for w in caught), caught


def test_an_optimizer_step_inside_the_step_steps_once_per_call() -> None:
    """``optimizer.step()`` inside the jitted function, gradients computed outside: it warned
    and still stepped twice on the first call (Adam's step count 2 against eager's 1)."""
    mine, theirs = _model(), _model()
    optimizers = [torch.optim.Adam(m.parameters(), lr=0.1) for m in (mine, theirs)]

    def make(model: nn.Module, optimizer: Any) -> Callable[[torch.Tensor], torch.Tensor]:
        def step(x: torch.Tensor) -> torch.Tensor:
            optimizer.step()
            optimizer.zero_grad()
            return (model(x) ** 2).mean()

        return step

    jitted, eager = ptj.jit(make(mine, optimizers[0])), make(theirs, optimizers[1])
    with pytest.warns(ptj.JitWarning, match=r"\.grad"):
        for i in range(3):
            x = torch.full((2, 3), 0.5 * (i + 1), dtype=torch.float64)
            got, want = jitted(x), eager(x)
            torch.testing.assert_close(got, want)
            got.backward()
            want.backward()
    for a, b in zip(mine.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b)
    states = [
        o.state[next(iter(m.parameters()))]["step"] for o, m in zip(optimizers, (mine, theirs))
    ]
    assert float(states[0]) == float(states[1]) == 2.0  # no gradients at the first call


def test_the_two_models_compared_start_equal_and_share_no_tensor() -> None:
    """What :func:`_calls` relies on: its eager and jitted models start from equal values, and
    a write to one is not seen by the other."""
    a, b = _model(), _model()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q)
        assert p.data_ptr() != q.data_ptr()
    with torch.no_grad():
        a[0].bias.add_(1.0)
    assert not torch.equal(a[0].bias, b[0].bias)


class _Stats(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))


def _other_state() -> tuple[nn.Module, torch.Tensor, nn.Module]:
    """A model, a closure tensor and a module the step never calls."""
    torch.manual_seed(0)
    return nn.Linear(2, 2), torch.zeros(()), _Stats()


STATE_WRITES: dict[str, Callable[[nn.Module, torch.Tensor, nn.Module], Any]] = {
    "a closure tensor": lambda model, count, stats: count.add_(1),
    "a buffer of a module not called": lambda model, count, stats: stats.calls.add_(1),
    "a module's buffer through a view": lambda model, count, stats: stats.calls.view(1).add_(1),
}


@pytest.mark.parametrize("branch", [False, True], ids=["straight", "branching on values"])
@pytest.mark.parametrize("write", list(STATE_WRITES))
def test_tensors_the_step_did_not_make_are_written_once_per_call(write: str, branch: bool) -> None:
    """State written in place besides arguments and the called modules' buffers (a counter in
    a closure, a module used only for its buffers) is written once per call: the trace is
    rewound past the write, and a compiled call whose value guard fails is undone."""

    def make() -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, nn.Module]:
        model, count, stats = _other_state()

        def step(x: torch.Tensor) -> torch.Tensor:
            STATE_WRITES[write](model, count, stats)
            y = model(x) + count + stats.calls
            return (y * 2 if x.sum() > 0 else y * 3) if branch else y

        return step, count, stats

    (step, count, stats), (eager, their_count, their_stats) = make(), make()
    jitted = ptj.jit(step)
    for i in range(6):
        x = torch.ones(2) * (1 if i % 2 == 0 or not branch else -1)
        torch.testing.assert_close(jitted(x), eager(x))
        torch.testing.assert_close(count, their_count)
        torch.testing.assert_close(stats.calls, their_stats.calls)


def test_a_hook_writing_another_modules_buffer_writes_it_once_per_call() -> None:
    def make() -> tuple[Callable[[torch.Tensor], torch.Tensor], nn.Module]:
        model, _, stats = _other_state()
        model.register_forward_hook(lambda module, args, out: stats.calls.add_(1) and None)
        return model, stats

    (model, stats), (eager, their_stats) = make(), make()
    jitted = ptj.jit(lambda x: model(x))
    for _ in range(4):
        x = torch.ones(1, 2)
        torch.testing.assert_close(jitted(x), eager(x))
        assert stats.calls.item() == their_stats.calls.item()


def test_tensors_the_step_makes_and_writes_are_not_copied() -> None:
    """A temporary written in place (``y = x * 2; y.add_(1)``) is the pass's own: nothing to
    rewind; a global tensor written in place is kept before its first write."""
    from phi_torch_jit._record import record

    total = torch.zeros(3)

    def step(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        y.add_(1)
        y[0] = 5.0
        total.add_(y)
        return y

    _, recording = record(step, (torch.ones(3),), {}, "step", [])
    assert [t for t, _ in recording.state.buffers.values()] == [total]
    torch.testing.assert_close(recording.state.buffers[id(total)][1], torch.zeros(3))


class _LazyInit(nn.Module):
    """Initializes its weight on the first call, behind a flag buffer, through an alias of the
    parameter (as gpytorch's variational strategies do with ``.data``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))
        self.register_buffer("ready", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.ready.item():
            with torch.no_grad():
                self.w.detach().copy_(torch.randn(2))
            self.ready.fill_(1)
        return x * self.w


def test_a_parameter_initialized_through_an_alias_behind_a_flag_matches_eager() -> None:
    """The trace is rewound to before the first call (the flag unset), so it traces the
    initialization; the compiled call whose value guard then fails wrote the weight through
    the alias, and is undone (it was not: the weight drawn again, a 1.5% loss difference on
    gpytorch's SVGP)."""
    mine, theirs = _LazyInit(), _LazyInit()
    jitted = ptj.jit(mine)
    for i in range(4):
        x = torch.ones(2) * (i + 1)
        torch.manual_seed(i)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # engine torchscript runs no_grad eagerly
            got = jitted(x)
        torch.manual_seed(i)
        torch.testing.assert_close(got, theirs(x))
        torch.testing.assert_close(mine.w, theirs.w)


def test_a_tensor_written_through_a_numpy_view_runs_eagerly_once_per_call() -> None:
    """``n = a.numpy(); n += 1``: no torch call sees the write (compiled calls dropped it: the
    tensor stopped at 2); reading through NumPy (``a.numpy().sum()``) is no write."""
    total = torch.zeros(2)

    def step(x: torch.Tensor) -> torch.Tensor:
        view = total.numpy()
        view += 1.0
        return x + total

    jitted = ptj.jit(step)
    with pytest.warns(ptj.JitWarning, match="NumPy view"):
        jitted(torch.ones(2))
    for calls in range(2, 6):
        torch.testing.assert_close(jitted(torch.ones(2)), torch.full((2,), 1.0 + calls))
    torch.testing.assert_close(total, torch.full((2,), 5.0))

    reader = ptj.jit(lambda x: x * float(total.numpy().sum()))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for _ in range(3):
            torch.testing.assert_close(reader(torch.ones(2)), torch.full((2,), 10.0))


def test_a_kept_alias_of_a_parameter_written_later_is_not_read_apart() -> None:
    """``cache["v"] = lin.weight.detach()`` on the first call, ``cache["v"].mul_(0.5)`` on
    every call: the captured tensor and the parameter share memory, which a captured graph
    took as two inputs (engine "compile" served the output of the weight before the write)."""

    def make() -> tuple[Callable[[torch.Tensor], torch.Tensor], nn.Module]:
        torch.manual_seed(0)
        lin, cache = nn.Linear(2, 2), {}

        def step(x: torch.Tensor) -> torch.Tensor:
            if "v" not in cache:
                cache["v"] = lin.weight.detach()
            cache["v"].mul_(0.5)
            return lin(x)

        return step, lin

    (step, lin), (eager, their_lin) = make(), make()
    jitted = ptj.jit(step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ptj.JitWarning)
        for _ in range(5):
            torch.testing.assert_close(jitted(torch.ones(2)), eager(torch.ones(2)))
            torch.testing.assert_close(lin.weight, their_lin.weight)


class _Windowed(nn.Module):
    """Holds a view of its own buffer as a plain attribute (``self.head = self.b[:3]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("b", torch.arange(6.0))
        self.head = self.b[:3]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.head


def test_a_view_of_a_buffer_the_step_only_reads_compiles_and_sees_writes() -> None:
    """Every buffer of a module that ran was taken as written, so a view of one held as an
    attribute "shared memory with a tensor it writes" and the step ran eagerly for good
    (probe 53b). A buffer the record pass does not write is no written tensor now; what the
    program reads of it is read live."""
    net = _Windowed()
    jitted = ptj.jit(lambda x: net(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for _ in range(3):
            torch.testing.assert_close(jitted(torch.ones(2, 3)), net(torch.ones(2, 3)))
        net.b.mul_(2.0)
        torch.testing.assert_close(jitted(torch.ones(2, 3)), torch.tensor([[0.0, 2.0, 4.0]] * 2))
    assert jitted.num_traces == 1


def test_a_view_of_a_buffer_the_step_writes_is_not_read_apart() -> None:
    """The step writes the buffer and reads its view after: still equal to eager (a captured
    graph would read the view's old value, so it runs eagerly there, warned)."""

    def make() -> tuple[Callable[[torch.Tensor], torch.Tensor], _Windowed]:
        net = _Windowed()

        def step(x: torch.Tensor) -> torch.Tensor:
            net.b.add_(1.0)
            return net(x)

        return step, net

    (step, net), (eager, theirs) = make(), make()
    jitted = ptj.jit(step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ptj.JitWarning)
        for _ in range(4):
            torch.testing.assert_close(jitted(torch.ones(3)), eager(torch.ones(3)))
            torch.testing.assert_close(net.b, theirs.b)


def test_a_tensor_made_under_the_id_of_a_freed_alias_is_not_that_alias() -> None:
    """The record pass keeps aliases (``p.detach()``) by id. One freed, and its id taken by a
    tensor a later torch call made, a write to that tensor was taken for a write to the
    aliased parameter: a PhiML solve's custom function "writes a tensor in place that it is
    not given" and the step ran eagerly, now and then, in the suite."""
    from types import SimpleNamespace

    from phi_torch_jit import _param_writes

    parameter, made = torch.ones(3), torch.zeros(3)
    recording = SimpleNamespace(made=set(), aliases={id(made): parameter})  # a stale entry
    with mock.patch.object(_param_writes, "_recording", return_value=recording):
        _param_writes.note_made((torch.ones(3),), None, made)
    assert id(made) in recording.made and id(made) not in recording.aliases
    assert _param_writes._written(made, recording.aliases) is made
