"""Classes of real models' code (issue "Real models from real libraries"), each reduced to
plain torch, on every engine: equal to eager (values, gradients, optimizer state, RNG draws),
or run eagerly with exactly one JitWarning that says why. Never a crash, never silently wrong.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from helpers import Counter, captures_graph, gradgradcheck, seeded
from torch import nn

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines

Step = Callable[..., Any]


def _run(step: Step, args: Any, calls: int) -> list[Any]:
    return [step(*args) for _ in range(calls)]


def _assert_equal(got: Any, want: Any) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def jitted_like_eager(
    make: Callable[[], tuple[Step, tuple[Any, ...]]], calls: int = 4, eager_reason: str = ""
) -> ptj.JitFunction[..., Any]:
    """Build the program twice from the same seed; run one eagerly and one jitted ``calls``
    times; results equal. ``eager_reason``: the jitted one must warn once with that text
    (and then runs eagerly); empty: it must not warn."""
    torch.manual_seed(0)
    step, args = make()
    want = _run(step, args, calls)
    torch.manual_seed(0)
    step, args = make()
    jitted = ptj.jit(step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _run(jitted, args, calls)
    ours = [w for w in caught if issubclass(w.category, ptj.JitWarning)]
    if eager_reason:
        assert len(ours) == 1, [str(w.message) for w in ours]
        assert eager_reason in str(ours[0].message)
    else:
        assert not ours, [str(w.message) for w in ours]
    _assert_equal(got, want)
    return jitted


def _training(model: nn.Module, x: torch.Tensor) -> tuple[Step, tuple[Any, ...]]:
    """A training step as users write it: loss, backward, optimizer step; returns the loss,
    the parameter gradients and the optimizer's state after the step."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        return model(x).square().mean()

    jittable = {"loss": loss_of}

    def step(x: torch.Tensor) -> Any:
        optimizer.zero_grad()
        loss = jittable["loss"](x)
        loss.backward()
        optimizer.step()
        grads = [p.grad.clone() for p in model.parameters()]
        moments = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
        return loss.detach(), grads, moments

    step.jittable = jittable  # type: ignore[attr-defined]
    return step, (x,)


# 1. A parameter or buffer slot set to None -----------------------------------------------


class _NoneSlots(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3, bias=False)
        self.conv = nn.Conv1d(1, 2, 3, padding=1, bias=False)
        self.norm = nn.LayerNorm(3, bias=False)
        self.register_buffer("shift", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.linear(x))
        y = self.conv(y.unsqueeze(1)).sum(1)
        return y if self.shift is None else y + self.shift


def test_parameters_and_buffers_set_to_none_train_like_eager() -> None:
    def make() -> tuple[Step, tuple[Any, ...]]:
        model = _NoneSlots()
        step, args = _training(model, torch.randn(5, 4))
        loss = ptj.jit(step.jittable["loss"])  # type: ignore[attr-defined]
        step.jittable["loss"] = loss  # type: ignore[attr-defined]
        return step, args

    torch.manual_seed(0)
    step, args = make()
    torch.manual_seed(0)
    eager = _NoneSlots()
    eager_step, _ = _training(eager, args[0])
    for _ in range(3):
        _assert_equal(step(*args), eager_step(*args))


def test_a_none_slot_filled_later_retraces() -> None:
    model = nn.Linear(3, 2, bias=False)
    f = ptj.jit(lambda x: model(x))
    x = torch.randn(4, 3)
    _assert_equal(f(x), model(x))
    f(x)
    model.bias = nn.Parameter(torch.ones(2))
    _assert_equal(f(x), model(x))
    assert f.num_traces == 2


# 3. ctx.needs_input_grad inside an autograd.Function's forward -----------------------------


class _Kernel(torch.autograd.Function):
    """Like a Gaussian-process kernel: forward refuses work nobody asked for."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if ctx.needs_input_grad[1]:
            raise RuntimeError("b must not require grad")
        ctx.save_for_backward(b)
        return a * b if ctx.needs_input_grad[0] else a * b + 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (b,) = ctx.saved_tensors
        return grad * b, None


def test_needs_input_grad_in_forward_is_eagers() -> None:
    f = ptj.jit(lambda a, b: _Kernel.apply(a, b))
    b = torch.randn(3)
    for requires in (True, False, True):
        a = torch.randn(3, requires_grad=requires)
        _assert_equal(f(a, b), _Kernel.apply(a, b))
        if requires:
            (got,) = torch.autograd.grad(f(a, b).sum(), a)
            _assert_equal(got, b)
    with torch.no_grad():
        _assert_equal(f(a, b), a * b + 1)
    with pytest.raises(RuntimeError, match="b must not require grad"):
        f(a, b.requires_grad_())


# 2. A seeded local generator ----------------------------------------------------------------


def test_draws_from_a_local_generator_run_eagerly_with_one_warning() -> None:
    def make() -> tuple[Step, tuple[Any, ...]]:
        g = seeded(7)
        return (lambda x: x + torch.randn(x.shape, generator=g)), (torch.zeros(3),)

    jitted = jitted_like_eager(make, eager_reason="a torch.Generator draw (randn)")
    assert "runs eagerly: it draws values a compiled program would repeat" in jitted.explain()


def test_a_generator_used_by_library_code_and_in_place_draws_are_noted() -> None:
    def make() -> tuple[Step, tuple[Any, ...]]:
        g = seeded(3)
        layer = nn.Dropout(0.0)  # library code between the user and the draw

        def step(x: torch.Tensor) -> torch.Tensor:
            noise = torch.empty_like(x).normal_(generator=g)
            return layer(x) + noise + torch.rand(3, generator=g)

        return step, (torch.zeros(3),)

    jitted_like_eager(make, eager_reason="torch.Generator draw")


def test_global_rng_draws_stay_compiled() -> None:
    jitted = jitted_like_eager(lambda: ((lambda x: x + torch.randn(x.shape)), (torch.zeros(3),)))
    assert jitted.num_traces == 1


# 4. Autograd inside the step: autograd.grad(create_graph=True), backward + optimizer --------


def test_autograd_grad_inside_the_step_is_compiled_where_graphs_are_captured(
    jit_engine: str,
) -> None:
    def make() -> tuple[Step, tuple[Any, ...]]:
        potential = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

        def forces(x: torch.Tensor) -> torch.Tensor:  # a force field: -grad of an energy
            x = x.detach().requires_grad_(True)
            energy = potential(x).sum()
            (grad,) = torch.autograd.grad(energy, x, create_graph=True)
            return -grad

        return forces, (torch.randn(5, 3),)

    # engines compile and auto capture it (tests/test_inner_grad.py); torchscript runs it eagerly
    eager_reason = "" if captures_graph(jit_engine) else "torch.autograd.grad at"
    jitted_like_eager(make, eager_reason=eager_reason)


def test_a_whole_training_step_inside_jit_equals_eager() -> None:
    def make() -> tuple[Step, tuple[Any, ...]]:
        model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
        step, args = _training(model, torch.randn(6, 3))
        return step, args

    jitted_like_eager(make, eager_reason="runs autograd inside the function")


# 6. What a tracer cannot follow: eager with one warning, never a crash -----------------------


def test_python_arithmetic_on_a_traced_size_never_crashes() -> None:
    def make() -> tuple[Step, tuple[Any, ...]]:
        linear = nn.Linear(8, 8)

        def step(x: torch.Tensor) -> torch.Tensor:
            modes = round(x.shape[-1] * 0.5)  # as U-shaped neural operators compute sizes
            return linear(x)[..., :modes]

        return step, (torch.randn(2, 8),)

    torch.manual_seed(0)
    step, args = make()
    want = _run(step, args, 3)
    torch.manual_seed(0)
    step, args = make()
    jitted = ptj.jit(step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _run(jitted, args, 3)
    _assert_equal(got, want)
    ours = [w for w in caught if issubclass(w.category, ptj.JitWarning)]
    assert len(ours) <= 1  # compiled where the engine follows it; else one warning
    if ours:
        assert "could not trace it: TypeError" in str(ours[0].message)


def test_a_tensor_requiring_grad_in_a_plain_object_is_compiled_as_an_input() -> None:
    def make() -> tuple[Step, tuple[Any, ...]]:
        holder = copy.copy(_Holder())
        holder.weight = torch.randn(3, requires_grad=True)
        return (lambda x: (x * holder.weight).sum()), (torch.ones(3),)

    jitted = jitted_like_eager(make)
    assert jitted.num_traces == 1


class _Holder:
    weight: torch.Tensor


# 5. Parameters reached through methods other than forward ---------------------------------


class _Gaussian(nn.Module):
    """A base distribution as flow libraries write it: parameters used by ``log_prob``."""

    def __init__(self) -> None:
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(2))
        self.log_scale = nn.Parameter(torch.zeros(2))

    def log_prob(self, z: torch.Tensor) -> torch.Tensor:
        return (-0.5 * ((z - self.loc) / self.log_scale.exp()) ** 2 - self.log_scale).sum(-1)


class _Flow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q0 = _Gaussian()
        self.scale = nn.Parameter(torch.ones(2))

    def inverse(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.scale

    def forward_kld(self, x: torch.Tensor) -> torch.Tensor:
        return -self.q0.log_prob(self.inverse(x)).mean() + self.scale.log().sum()


@pytest.mark.parametrize("how", ["closure", "bound method"])
def test_parameters_reached_through_other_methods_train_like_eager(how: str) -> None:
    torch.manual_seed(0)
    flows = [_Flow(), _Flow()]
    flows[1].load_state_dict(flows[0].state_dict())
    model = flows[0]
    loss = (
        ptj.jit(lambda x: model.forward_kld(x)) if how == "closure" else ptj.jit(model.forward_kld)
    )
    optimizers = [torch.optim.Adam(f.parameters(), lr=0.1) for f in flows]
    for _ in range(3):
        x = torch.randn(8, 2)
        for optimizer, f in zip(optimizers, (loss, flows[1].forward_kld)):
            optimizer.zero_grad()
            f(x).backward()
            optimizer.step()
        for p, q in zip(flows[0].parameters(), flows[1].parameters()):
            _assert_equal(p, q)
    assert loss.num_traces == 1


# 7. Values that decide the path on every call (adaptive step sizes) ------------------------


def test_a_signature_whose_values_never_repeat_ends_up_eager_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from phi_torch_jit._pipeline import VALUE_SPECIALIZATIONS

    def adaptive(y: torch.Tensor) -> torch.Tensor:  # a step size from float(err), per call
        h = min(0.2, 0.05 / (float(y.abs().max()) + 1e-3))
        return y + h * torch.tanh(y)

    step = ptj.jit(adaptive)
    inputs = [torch.randn(4) for _ in range(VALUE_SPECIALIZATIONS + 4)]
    with caplog.at_level("WARNING", logger="phi_torch_jit"), pytest.warns(ptj.JitWarning) as caught:
        for x in inputs:
            _assert_equal(step(x), adaptive(x))
    assert len(caught) == 1 and "tensor values its Python branches on" in str(caught[0].message)
    assert caught[0].filename == __file__  # at the user's call
    assert step.num_traces == VALUE_SPECIALIZATIONS  # then no more compiles
    (only,) = step.specializations  # the compiled ones are dropped: a lookup, not a scan
    assert only.eager_reason.startswith("tensor values its Python branches on changed the path")
    assert sum("runs eagerly: tensor values" in r.getMessage() for r in caplog.records) == 1
    with mock.patch.object(torch, "tanh", wraps=torch.tanh) as tanh:
        step(inputs[0])
    assert tanh.call_count == 1  # eager: the Python runs, once per call


# Found by the corpus (gpytorch's RBF kernel): a backward returning a broadcast-shaped gradient


class _ScaleBy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, scale)
        return x * scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, scale = ctx.saved_tensors
        return grad * scale, grad * x  # (3, 3) for a (1, 1) scale: autograd sums it down


def test_a_gradient_shaped_like_the_broadcast_is_summed_down_like_eager() -> None:
    x = torch.randn(3, 3)
    scales = [torch.full((1, 1), 2.0, requires_grad=True) for _ in range(2)]
    f = ptj.jit(lambda x, s: _ScaleBy.apply(x, s).sum())
    for _ in range(2):
        for s in scales:
            s.grad = None
        f(x, scales[0]).backward()
        _ScaleBy.apply(x, scales[1]).sum().backward()
        _assert_equal(scales[0].grad, scales[1].grad)


# Found by the corpus: multi-layer GRU/LSTM with dropout in train mode ----------------------


class _Outputs(nn.Module):
    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "kind, options",
    [(nn.GRU, {}), (nn.LSTM, {}), (nn.LSTM, {"bidirectional": True, "num_layers": 3}),
     (nn.RNN, {"nonlinearity": "relu"}), (nn.LSTM, {"proj_size": 2})],
    ids=["GRU", "LSTM", "LSTM-3-bidirectional", "RNN-relu", "LSTM-proj"],
)  # fmt: skip
@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported")  # torch's, eager too
def test_multi_layer_rnns_with_dropout_train_like_eager(
    kind: type[nn.Module], options: dict[str, Any], jit_engine: str
) -> None:
    """torch's RNN decomposition (applied by AOTAutograd) drops inter-layer dropout: captured
    graphs run such an RNN layer by layer with eager's dropout between (``_rnn_layers``); the
    draws, losses and parameters equal eager's over several training steps, compiled."""

    def make() -> tuple[Step, tuple[Any, ...]]:
        rnn = kind(3, 4, **{"num_layers": 2, "dropout": 0.5, **options})
        return _training(_Outputs(rnn), torch.randn(5, 2, 3))

    def make_jitted() -> tuple[Step, tuple[Any, ...]]:
        step, args = make()
        step.jittable["loss"] = ptj.jit(step.jittable["loss"])  # type: ignore[attr-defined]
        return step, args

    # cuDNN's RNNs draw their dropout from a state of their own, made once per process: eager
    # on cuDNN repeats no seed, so CUDA compares with torch's own RNN kernels (docs/gpu.md)
    with torch.backends.cudnn.flags(enabled=False):
        torch.manual_seed(0)
        step, args = make()
        want = _run(step, args, 3)
        torch.manual_seed(0)
        step, args = make_jitted()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _assert_equal(_run(step, args, 3), want)
    assert not [str(w.message) for w in caught if issubclass(w.category, ptj.JitWarning)]
    assert step.jittable["loss"].num_traces == 1  # type: ignore[attr-defined]


# Found by the corpus (torchode): a size read from a value-shaped tensor ---------------------


def test_len_of_a_value_shaped_tensor_is_never_baked() -> None:
    def gather(x: torch.Tensor) -> torch.Tensor:
        i = x.nonzero()[:, 0]
        return x[i].reshape(len(i)) * 2

    jitted = ptj.jit(gather)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in (torch.tensor([1.0, 0, 2, 3]), torch.tensor([1.0, 0, 0, 3]), torch.zeros(4)):
            _assert_equal(jitted(x), gather(x))
    ours = [w for w in caught if issubclass(w.category, ptj.JitWarning)]
    assert len(ours) <= 1  # engine torchscript: eager, said once; capturing engines: eager too
    assert not [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)]


# 8. Found by the corpus (nn.Transformer, torchscript): random draws on independent branches --


def test_independent_random_draws_keep_eagers_order() -> None:
    """TorchScript's optimizing executor moved a draw past an independent one (the RNG is no
    dependency to it): from the second compiled call on, every draw shifted."""
    weight = nn.Parameter(torch.randn(8, 8))

    def draws(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = nn.functional.dropout(torch.tanh(x * weight), 0.5)
        attention = nn.functional.scaled_dot_product_attention(y, y, y, dropout_p=0.3)
        return hidden, torch.rand_like(y) + attention

    jitted = ptj.jit(draws)
    x, y = torch.randn(8, 8), torch.randn(2, 4, 8)
    for seed in range(5):
        torch.manual_seed(seed)
        want = draws(x, y)
        torch.manual_seed(seed)
        _assert_equal(jitted(x, y), want)
    assert jitted.num_traces == 1


# Found by the corpus (torchode, torchscript): a program that raises where eager runs -------


def _scatter_hits(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """With exactly one hit, torch's setitem drops v's leading 1: TorchScript traces that as
    view(v[idx], [3]), a size baked without a TracerWarning, which raises for two hits."""
    x.add_(1)
    y = torch.zeros(4, 3)
    idx = (x > 1).nonzero()[:, 0]
    y[idx] = v[idx]
    return y


def _like_eager_on(
    fn: Step, inputs: list[list[float]], v: torch.Tensor
) -> tuple[ptj.JitFunction[..., Any], list[str]]:
    """``jit(fn)`` called on each of ``inputs`` (with ``v``), equal to ``fn``, the written
    argument too; the JitWarning messages it gave."""
    jitted = ptj.jit(fn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for values in inputs:
            ours, theirs = torch.tensor(values), torch.tensor(values)
            _assert_equal(jitted(ours, v), fn(theirs, v))
            _assert_equal(ours, theirs)  # a program's write was undone before eager ran
    return jitted, [str(w.message) for w in caught if issubclass(w.category, ptj.JitWarning)]


def test_a_program_that_raises_where_eager_runs_runs_eagerly_with_one_warning(
    jit_engine: str,
) -> None:
    hits = [[1.0, 0, 0, 0], [1.0, 0, 0, 0], [1.0, 1, 0, 0], [1.0, 1, 1, 0]]
    jitted, ours_warned = _like_eager_on(_scatter_hits, hits, torch.randn(4, 3))
    if captures_graph(jit_engine):
        # NOTE [value-dependent sizes]: with one hit the graph bakes a size (setitem's view to
        # [3]), so that program keeps nonzero's size guarded, the write to x undone when the
        # guard fails; the program traced for two hits leaves the size dynamic and serves three
        assert not ours_warned, ours_warned
        assert jitted.num_traces == 2
    else:  # traced on one hit, TorchScript's program raises for two: eager, said once
        assert len(ours_warned) == 1 and "compiled program raised" in ours_warned[0]
        assert jitted.num_traces == 1


def _scatter_if_any(t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    y = torch.zeros(3, 3)
    hit = t > 0
    if hit.any():  # a value guard: the program is for this path only
        idx = hit.nonzero()[:, 0]
        y[idx] = v[idx]
    return y


def test_a_program_with_value_guards_that_raises_is_a_miss(jit_engine: str) -> None:
    paths = [[1.0, -1, -1], [-1.0, -1, -1], [1.0, -1, -1], [-1.0, -1, -1]]
    jitted, ours_warned = _like_eager_on(_scatter_if_any, paths, torch.randn(3, 3))
    # one program per path, each reused: a miss, not a retrace per call (capturing engines:
    # the count of hits is guarded too, and is the same on every call of the first path)
    assert not ours_warned, ours_warned
    assert jitted.num_traces == 2


def test_an_error_eager_raises_too_is_raised_as_eager_raises_it() -> None:
    calls = Counter()

    def pick(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        calls.forward += 1
        return x.index_select(0, i) * 2

    jitted = ptj.jit(pick, side_effects="trace")
    # on the CPU: on CUDA an index out of range is a device-side assert, which ends the process's
    # use of the device, eagerly as compiled
    x = torch.randn(4, device="cpu")
    index = functools.partial(torch.tensor, device="cpu")
    _assert_equal(jitted(x, index([1])), x[1:2] * 2)
    with pytest.raises((IndexError, RuntimeError), match="out of range"):
        jitted(x, index([9]))
    before = calls.forward
    _assert_equal(jitted(x, index([2])), x[2:3] * 2)
    assert calls.forward == before  # compiled still: the error was the user's, not ours
    assert not any(s.failed for s in jitted.specializations)


# Double backward through a jitted function (a PINN residual outside the jitted model) -------


def test_gradients_of_a_jitted_model_differentiate_again_like_eager() -> None:
    torch.manual_seed(0)
    nets = [nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1)) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    model = ptj.jit(nets[0])
    for _ in range(3):
        points = torch.randn(8, 2)
        for net, f in ((nets[0], model), (nets[1], nets[1])):
            net.zero_grad()
            x = points.clone().requires_grad_()
            (du,) = torch.autograd.grad(f(x).sum(), x, create_graph=True)
            du.square().mean().backward()  # a residual of the derivative: double backward
        for p, q in zip(nets[0].parameters(), nets[1].parameters()):
            # the last bias does not reach the derivative: eager leaves None, TorchScript's
            # differentiated graph a zero (noted in docs/design.md)
            zero = torch.zeros_like(p)
            _assert_equal(zero if p.grad is None else p.grad, zero if q.grad is None else q.grad)
    assert model.num_traces == 1


def test_gradgradcheck_through_jit() -> None:
    weight = torch.randn(3, 3, dtype=torch.float64)
    f = ptj.jit(lambda x: torch.tanh(x @ weight).sin())
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    assert gradgradcheck(f, (x,))
    y = f(x).sum()
    (first,) = torch.autograd.grad(y, x)
    _assert_equal(first, torch.autograd.grad(torch.tanh(x @ weight).sin().sum(), x)[0])


# Earlier checks of realistic programs: inputs in other memory layouts ----------------------


def test_non_contiguous_and_channels_last_inputs_equal_eager() -> None:
    conv = nn.Conv2d(3, 4, 3)
    jitted = ptj.jit(lambda x: conv(x).relu().sum(1))
    layouts = [
        torch.randn(2, 3, 8, 8),
        torch.randn(2, 3, 8, 8).transpose(-1, -2),
        torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last),
    ]
    for x in layouts:
        _assert_equal(jitted(x), conv(x).relu().sum(1))
    columns = ptj.jit(lambda a: a * 2 + a.sum(0))
    y = torch.randn(6, 4).t()
    for a in (y, y.contiguous(), y):
        _assert_equal(columns(a), a * 2 + a.sum(0))


# Found by the PhiFlow programs: a trace that returns another structure than its record pass -


class _Count:
    n = 0


class _Ticks:
    """Python state the guards cannot see (a counter of a class that names a module without
    a file, as a library's would, kept on an object of another such class under a name the
    step does not spell: its methods' reads of their own object are guarded, not deeper
    state), read once per pass."""

    def __init__(self) -> None:
        self._count = _Count()

    def next(self) -> int:
        self._count.n += 1
        return self._count.n - 1


_Ticks.__module__ = _Count.__module__ = "builtins"


def test_a_trace_returning_another_structure_runs_eagerly_with_one_warning() -> None:
    ticks = _Ticks()

    def step(x: torch.Tensor) -> tuple[torch.Tensor, dict[str, int]]:
        return x * 2, {"tick": ticks.next()}

    jitted = ptj.jit(step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [jitted(torch.ones(2)) for _ in range(3)]
    ours = [str(w.message) for w in caught if issubclass(w.category, ptj.JitWarning)]
    assert len(ours) == 1 and "returned a different structure while tracing" in ours[0]
    first, *later = [r[1]["tick"] for r in results]
    assert later == [first + 2, first + 3]  # eager from the second call: one read per call
    for got, _ in results:
        _assert_equal(got, torch.full((2,), 2.0))
