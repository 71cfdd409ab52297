"""State a step reads through what it holds or iterates (NOTE [attribute paths]): a partial's
arguments, a bound method's ``self``, a jitted module's own attributes, the user's modules
used as configuration, lists iterated by a loop, iterators, per-call ``autograd.Function``
classes, and inputs made under ``torch.inference_mode``. Each is guarded (a change retraces)
or runs eagerly with one JitWarning; never a stale value. Every engine (shared suite)."""

from __future__ import annotations

import array
import collections
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import importlib
import io
import mmap
import pickle
import queue
import struct
import types
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import read_settings
import torch
from helpers import like_eager_after_each, seeded
from test_state_paths import _Counting
from torch import nn
from torch.overrides import TorchFunctionMode

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines


def _stays_like_eager(jitted: Callable[..., Any], eager: Callable[..., Any],
                      change: Callable[[], None]) -> None:  # fmt: skip
    x = torch.linspace(1, 2, 3)
    for _ in range(2):
        torch.testing.assert_close(jitted(x), eager(x))
    change()
    for _ in range(2):
        torch.testing.assert_close(jitted(x), eager(x))


class Config:
    def __init__(self, alpha: float) -> None:
        self.alpha = alpha


def relax(x: torch.Tensor, cfg: Config) -> torch.Tensor:
    return x * cfg.alpha + 1


def test_state_behind_a_partial_keyword_or_argument_retraces() -> None:
    cfg = Config(0.3)
    step = functools.partial(relax, cfg=cfg)
    jitted = ptj.jit(step)
    _stays_like_eager(jitted, step, lambda: setattr(cfg, "alpha", 0.7))
    assert jitted.num_traces == 2
    positional = Config(0.3)
    step2 = functools.partial(lambda cfg, x: relax(x, cfg), positional)
    jitted2 = ptj.jit(step2)
    _stays_like_eager(jitted2, step2, lambda: setattr(positional, "alpha", 0.9))
    assert jitted2.num_traces == 2


class Simulation:
    def __init__(self) -> None:
        self.dt = 0.1
        self.stages = [Config(1.0), Config(1.5)]

    def step(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = x * stage.alpha + self.dt
        return x


def test_a_bound_methods_self_is_guarded_attributes_and_lists() -> None:
    sim = Simulation()
    jitted = ptj.jit(sim.step)
    _stays_like_eager(jitted, sim.step, lambda: setattr(sim, "dt", 0.5))
    _stays_like_eager(jitted, sim.step, lambda: setattr(sim.stages[1], "alpha", 2.0))
    _stays_like_eager(jitted, sim.step, lambda: sim.stages.append(Config(3.0)))
    assert jitted.num_traces == 4


STAGES = [Config(1.0), Config(1.5)]


def staged(x: torch.Tensor) -> torch.Tensor:
    for stage in STAGES:
        x = x * stage.alpha + 1
    return x


def test_a_loop_over_a_global_list_sees_changed_items_and_appends() -> None:
    jitted = ptj.jit(staged)
    _stays_like_eager(jitted, staged, lambda: setattr(STAGES[1], "alpha", 2.0))
    _stays_like_eager(jitted, staged, lambda: STAGES.append(Config(0.5)))
    _stays_like_eager(jitted, staged, lambda: STAGES.pop(0))
    assert jitted.num_traces == 4


def gravity(x: torch.Tensor) -> torch.Tensor:
    return x * read_settings.GRAVITY + read_settings.TABLE["drag"][1]


def through_function(x: torch.Tensor) -> torch.Tensor:
    return read_settings.scaled(x) + 1


RUNTIME = types.ModuleType("runtime_config")
RUNTIME.K = 2.0  # type: ignore[attr-defined]


def runtime(x: torch.Tensor) -> torch.Tensor:
    return x * RUNTIME.K  # type: ignore[attr-defined]


@pytest.fixture
def fresh_settings() -> Any:
    yield
    importlib.reload(read_settings)
    RUNTIME.K = 2.0  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("fn", "change"),
    [
        (gravity, lambda: setattr(read_settings, "GRAVITY", 1.0)),
        (gravity, lambda: read_settings.TABLE["drag"].__setitem__(1, 5.0)),
        (through_function, lambda: setattr(read_settings, "GRAVITY", 3.0)),
        (runtime, lambda: setattr(RUNTIME, "K", 3.0)),
    ],
)
def test_the_users_modules_are_configuration(fn: Any, change: Any, fresh_settings: Any) -> None:
    jitted = ptj.jit(fn)
    _stays_like_eager(jitted, fn, change)
    assert jitted.num_traces == 2


def test_library_modules_are_compared_not_walked() -> None:
    from phi_torch_jit._reads import collect_reads
    from phi_torch_jit._reads._records import Kind

    step = lambda x: torch.sin(x) * functools.reduce(max, [1, 2])  # noqa: E731
    reads = collect_reads(step, [])
    # the lambda's own code and attributes, which module each global holds (a variable may be
    # rebound to another: ``xp = np``), and its module not shadowing the builtin max; nothing
    # of torch's or functools' content, and not the builtin max, which Python resolves
    assert sorted(r.source.label for r in reads) == sorted([
        f"{step.__qualname__}.__code__",
        f"{step.__qualname__} attributes",
        "global torch",
        "global functools",
        "globals not defining max...",
    ])  # fmt: skip
    modules = [r for r in reads if r.source.label.startswith("global ")]
    assert [r.kind for r in modules] == [Kind.VALUE, Kind.VALUE]
    assert {r.expected for r in modules} == {torch, functools}


def test_a_jitted_module_that_counts_its_calls_runs_eagerly_like_eager() -> None:
    model, twin = _Counting(), _Counting()  # counts its calls, branches on the count
    twin.load_state_dict(model.state_dict())
    jitted = ptj.jit(model)
    x = torch.ones(2, 3)
    with pytest.warns(ptj.JitWarning, match="_Counting.calls"):
        results = [jitted(x) for _ in range(5)]
    for got in results:
        torch.testing.assert_close(got, twin(x))
    assert model.calls == twin.calls == 5


def test_an_iterator_read_by_the_step_runs_eagerly_with_one_warning() -> None:
    forcing = iter([1.0, 2.0, 3.0, 4.0])

    def forced(x: torch.Tensor) -> torch.Tensor:
        return x + next(forcing)

    jitted = ptj.jit(forced)
    x = torch.zeros(2)
    with pytest.warns(ptj.JitWarning, match="reads an iterator") as caught:
        got = [jitted(x)[0].item() for _ in range(4)]
    assert got == [1.0, 2.0, 3.0, 4.0]
    assert sum(issubclass(w.category, ptj.JitWarning) for w in caught) == 1


class Operator:
    def __init__(self, matrix: torch.Tensor) -> None:
        self.matrix = matrix


def _solve(op: Operator, b: torch.Tensor) -> torch.Tensor:
    class Richardson(torch.autograd.Function):  # a new class on every call
        @staticmethod
        def forward(ctx: Any, b: torch.Tensor) -> torch.Tensor:
            x = torch.zeros_like(b)
            for _ in range(4):
                x = x + 0.1 * (b - op.matrix @ x)
            return x

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return 0.4 * g

    return Richardson.apply(b)  # type: ignore[no-untyped-call,no-any-return]


def _assert_like_eager_with_input_gradients(
    jitted: Callable[..., Any], step: Callable[..., Any], a: torch.Tensor, b: torch.Tensor
) -> None:
    """``step(a, b)`` jitted and eager: equal values, and equal gradients of ``b``."""
    bs = [b.clone().requires_grad_(True) for _ in range(2)]
    got, want = jitted(a, bs[0]), step(a, bs[1])
    torch.testing.assert_close(got, want)
    got.backward()
    want.backward()
    torch.testing.assert_close(bs[0].grad, bs[1].grad)


def test_a_function_class_defined_per_call_is_compiled_with_its_tensors_as_inputs() -> None:
    """A new class on every call, closing over that call's operator: the matrix is an input
    of the compiled custom function (taken from each call's objects), never the first call's;
    its backward runs with the same matrix; one trace, no warning."""

    def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _solve(Operator(a * 2), b).square().sum()

    jitted = ptj.jit(step)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for seed in range(4):
            a = torch.eye(4) * (seed + 1) + 0.1 * torch.randn(4, 4)
            _assert_like_eager_with_input_gradients(jitted, step, a, torch.randn(4))
    assert jitted.num_traces == 1
    assert "runs eagerly" not in jitted.explain()


@dataclasses.dataclass(frozen=True)
class _SPD:
    matrix: torch.Tensor
    tol: float = 1e-6

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        return self.matrix @ x


def _cg(op: Any, b: torch.Tensor, iterations: int = 4) -> torch.Tensor:
    """An iterative-solver library's shape: a Function class per call, the operator closed
    over (here also through a local function), the backward solving the adjoint system."""
    matvec = op.matvec if not callable(op) else op

    def solve(rhs: torch.Tensor) -> torch.Tensor:
        x = torch.zeros_like(rhs)
        r = rhs - matvec(x)
        p = r
        for _ in range(iterations):
            ap = matvec(p)
            alpha = (r @ r) / (p @ ap)
            x, r_new = x + alpha * p, r - alpha * ap
            p, r = r_new + (r_new @ r_new) / (r @ r) * p, r_new
        return x

    class CG(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, b: torch.Tensor) -> torch.Tensor:
            return solve(b)

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return solve(g)  # symmetric: the adjoint solve is the same

    return CG.apply(b)  # type: ignore[no-untyped-call,no-any-return]


@pytest.mark.parametrize("how", ["dataclass", "closure"])
def test_a_cg_class_made_per_call_solves_each_calls_matrix(how: str) -> None:
    """Issue's case: 4 CG steps on a new SPD matrix per call (compiled calls kept the first
    call's matrix: 0.179 where eager gives 0.164). The matrix reaches the solve through a
    frozen dataclass's method or through a local function's closure."""

    def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        spd = a @ a.T + 4 * torch.eye(4)
        op = _SPD(spd) if how == "dataclass" else (lambda x: spd @ x)
        return _cg(op, b).square().sum()

    jitted = ptj.jit(step)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for seed in range(4):
            g = seeded(seed)
            a, b = torch.randn(4, 4, generator=g), torch.randn(4, generator=g)
            _assert_like_eager_with_input_gradients(jitted, step, a, b)
    assert jitted.num_traces == 1


def _solve_in_tuple(pair: tuple[torch.Tensor, float], b: torch.Tensor) -> torch.Tensor:
    class Shifted(torch.autograd.Function):  # a tensor in a tuple: cannot be swapped
        @staticmethod
        def forward(ctx: Any, b: torch.Tensor) -> torch.Tensor:
            return b + pair[0] * pair[1]

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g

    return Shifted.apply(b)  # type: ignore[no-untyped-call,no-any-return]


def test_a_per_call_class_whose_tensors_cannot_be_inputs_runs_eagerly_never_stale() -> None:
    def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _solve_in_tuple((a, 2.0), b)

    jitted = ptj.jit(step)
    b = torch.ones(4)
    with pytest.warns(ptj.JitWarning, match=r"Shifted.*closing over pair\[0\] is a tensor"):
        for seed in range(3):
            a = torch.full((4,), float(seed))
            torch.testing.assert_close(jitted(a, b), step(a, b))


def _factory(op: Operator) -> Any:
    class Scaled(torch.autograd.Function):  # made once, before any call
        @staticmethod
        def forward(ctx: Any, b: torch.Tensor) -> torch.Tensor:
            return op.matrix @ b

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return op.matrix.T @ g

    return Scaled


def test_a_function_class_made_once_by_a_factory_is_compiled() -> None:
    op = Operator(torch.eye(4) * 2)
    scaled = _factory(op)

    def step(b: torch.Tensor) -> torch.Tensor:
        return scaled.apply(b) * 2  # type: ignore[no-any-return]

    jitted = ptj.jit(step)
    b = torch.ones(4)
    for _ in range(2):
        torch.testing.assert_close(jitted(b), step(b))
    op.matrix.mul_(3)  # a tensor it closes over: an input of the program
    torch.testing.assert_close(jitted(b), step(b))
    assert jitted.num_traces == 1


def test_first_call_under_inference_mode_then_training() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    twin = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    twin.load_state_dict(model.state_dict())
    jitted = ptj.jit(model)
    with torch.inference_mode():
        x = torch.randn(16, 4)
        torch.testing.assert_close(jitted(x), twin(x))
    x = torch.randn(16, 4)
    for _ in range(2):
        loss, eager = jitted(x).square().mean(), twin(x).square().mean()
        loss.backward()
        eager.backward()
        torch.testing.assert_close(loss, eager)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


class _RunningError(nn.Module):
    """A metric that keeps its state as a plain tensor attribute and rebinds it per call."""

    def __init__(self) -> None:
        super().__init__()
        self.total = torch.zeros(())

    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.total = self.total + (pred - target).square().sum()
        return self.total


class _RunningMean(nn.Module):
    """State in a registered buffer, rebound (not updated in place): compiled, the new value
    written into the buffer (NOTE [side effects once])."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(3))
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mean = 0.9 * self.mean + 0.1 * x.detach().mean(0)
        return self.linear(x) - self.mean


@pytest.mark.parametrize("jit_the_module", [True, False])
def test_a_tensor_attribute_a_module_rebinds_in_the_step_runs_eagerly(
    jit_the_module: bool,
) -> None:
    model, twin = _RunningError(), _RunningError()
    jitted = ptj.jit(model) if jit_the_module else ptj.jit(lambda a, b: model(a, b) * 2)
    scale = 1 if jit_the_module else 2
    with pytest.warns(ptj.JitWarning, match="changes Python state it reads.*total"):
        for _ in range(4):
            args = [torch.randn(5, 3) for _ in range(2)]
            torch.testing.assert_close(jitted(*args), twin(*args) * scale)
    torch.testing.assert_close(model.total, twin.total)


@pytest.mark.parametrize("jit_the_module", [True, False])
def test_a_buffer_a_module_rebinds_in_the_step_is_compiled_and_written(
    jit_the_module: bool,
) -> None:
    model, twin = _RunningMean(), _RunningMean()
    twin.load_state_dict(model.state_dict())
    jitted = ptj.jit(model) if jit_the_module else ptj.jit(lambda x: model(x) * 2)
    scale = 1 if jit_the_module else 2
    for _ in range(4):
        x = torch.randn(5, 3)
        torch.testing.assert_close(jitted(x), twin(x) * scale)
    torch.testing.assert_close(model.mean, twin.mean)
    assert jitted.num_traces == 1


# Found by probing programs written as scripts write them (each: silently the first value) ---


def _equal_before_and_after(
    step: Callable[..., Any], change: Callable[[], None], *more: Any
) -> Any:
    """Jitted and eager on ``(ones(3), *more)`` over 3 calls, ``change()``, 3 more calls: equal
    each time, no warning; returns the jitted function."""
    jitted = ptj.jit(step)
    x = torch.ones(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for phase in range(2):
            for _ in range(3):
                torch.testing.assert_close(jitted(x, *more), step(x, *more))
            if phase == 0:
                change()
    return jitted


class _Tempered(nn.Module):
    SCALE = 1.0  # a class constant the step reads as self.SCALE

    def __init__(self) -> None:
        super().__init__()
        self._temperature = 1.0  # a "private" attribute: state all the same

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.SCALE / self._temperature


@pytest.mark.parametrize("what", ["private attribute", "class attribute"])
def test_a_modules_private_and_class_attributes_are_guarded(what: str) -> None:
    class Net(_Tempered):  # its own class: the class attribute changes for this test only
        pass

    net = Net()

    def change() -> None:
        if what == "private attribute":
            net._temperature = 4.0
        else:
            Net.SCALE = 3.0

    jitted = _equal_before_and_after(net, change)
    assert jitted.num_traces == 2


class _Configured(nn.Module):
    """Keeps its settings past ``nn.Module.__setattr__`` and answers names from them in a
    ``__getattr__`` of its own, reading the dict by a string: ``self.__dict__["_cfg"]``."""

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "_cfg", {"gain": 1.0})

    def __getattr__(self, name: str) -> Any:
        settings = self.__dict__["_cfg"]
        return settings[name] if name in settings else super().__getattr__(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def test_a_modules_private_dict_named_only_as_a_string_is_guarded() -> None:
    """Probe 40c: a module's private attributes are its state where code of yours names
    them (a library base's are its own); a name spelled only as a string
    (``self.__dict__["_cfg"]``, ``object.__setattr__(self, "_cfg", ...)``) did not count, and
    ``m._cfg["gain"] = 5.0`` or a new dict kept the traced gain on every engine."""
    net = _Configured()
    jitted, x = ptj.jit(net), torch.ones(3)

    def gain(value: float) -> Callable[[], None]:
        return lambda: net._cfg.__setitem__("gain", value)

    renewed = lambda: object.__setattr__(net, "_cfg", {"gain": 7.0})  # noqa: E731
    like_eager_after_each(jitted, lambda f: f(x), net, [gain(5.0), renewed, gain(1.0)])


class _Dunders(nn.Module):
    """Keeps a number and a dict of its own under ``__x__`` names."""

    def __init__(self) -> None:
        super().__init__()
        self.__scale__ = 2.0
        self.__cfg__ = {"k": 1.0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.__scale__ + self.__cfg__["k"]


def test_a_modules_attributes_under_dunder_names_of_yours_are_guarded() -> None:
    """A module's ``__x__`` attributes were skipped, both the immutable ones the module guard
    compares and the containers read as state: ``m.__scale__ = 5.0`` and
    ``m.__cfg__["k"] = 7.0`` kept the traced values on every engine. Only the names Python
    puts there are skipped now (as for functions, instances and classes, probe 39a)."""
    net = _Dunders()
    jitted, x = ptj.jit(net), torch.ones(3)
    scale = lambda: setattr(net, "__scale__", 5.0)  # noqa: E731
    entry = lambda: net.__cfg__.__setitem__("k", 7.0)  # noqa: E731
    like_eager_after_each(jitted, lambda f: f(x), net, [scale, entry])


class _FromStateDict(nn.Module):
    """Multiplies by what its own ``state_dict()`` holds."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("a", torch.ones(3))
        self.register_buffer("b", torch.full((3,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for value in self.state_dict(keep_vars=True).values():
            x = x * value
        return x


def _tripled_b(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
    state[prefix + "b"] = state[prefix + "b"] * 3


def test_what_decides_a_state_dict_read_in_the_step_is_guarded() -> None:
    """Probe 41b: a step reading ``state_dict()`` kept the traced entries when a buffer left
    it (``register_buffer(..., persistent=False)``: same tensor, same name) or a state-dict
    hook was added, on every engine. Which buffers it leaves out and its hooks are guarded
    where the record pass saw ``state_dict()`` run."""
    net = _FromStateDict()
    jitted, x = ptj.jit(net), torch.ones(3)
    handles: list[Any] = []

    def hook() -> None:
        handles.append(net.register_state_dict_post_hook(_tripled_b))  # type: ignore[arg-type]

    changes = [
        lambda: net.register_buffer("b", net.b, persistent=False),
        lambda: net.register_buffer("b", net.b, persistent=True),
        hook,
        lambda: handles.pop().remove(),
    ]
    like_eager_after_each(jitted, lambda f: f(x), net, changes)


ACTIVATIONS = {"act": torch.tanh}


def test_a_torch_builtin_held_in_a_dict_is_guarded_by_identity() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return ACTIVATIONS["act"](x)

    def change() -> None:
        ACTIVATIONS["act"] = torch.sigmoid

    try:
        assert _equal_before_and_after(step, change).num_traces == 2
    finally:
        ACTIVATIONS["act"] = torch.tanh


@dataclasses.dataclass
class _Term:
    coef: float

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.coef


def test_the_object_of_a_bound_method_held_in_a_list_or_a_module_is_guarded() -> None:
    term = _Term(1.0)
    terms = [term.apply]
    holder = nn.Module()
    holder.fn = term.apply  # type: ignore[assignment]

    def step(x: torch.Tensor) -> torch.Tensor:
        return terms[0](x) + holder.fn(x)

    def change() -> None:
        term.coef = 5.0

    assert _equal_before_and_after(step, change).num_traces == 2


COEFFICIENTS = [1.0]


def _relax(coefficients: list[float], x: torch.Tensor) -> torch.Tensor:
    return x * coefficients[0]


RELAX = functools.partial(_relax, COEFFICIENTS)


def test_a_list_bound_by_a_global_partial_is_guarded_by_content() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return RELAX(x)

    def change() -> None:
        COEFFICIENTS[0] = 5.0

    try:
        assert _equal_before_and_after(step, change).num_traces == 2
    finally:
        COEFFICIENTS[0] = 1.0


def test_the_default_dtype_is_part_of_the_cache_key() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return x.sum() + torch.ones(3)

    jitted = ptj.jit(step)
    x = torch.ones(3)
    try:
        for dtype in (torch.float32, torch.float64, torch.float32):
            torch.set_default_dtype(dtype)
            for _ in range(2):
                got = jitted(x)
                assert got.dtype == step(x).dtype == dtype
                torch.testing.assert_close(got, step(x))
    finally:
        torch.set_default_dtype(torch.float32)
    assert jitted.num_traces == 2
    assert "default dtype float64" in jitted.explain()


class _TimesTen(TorchFunctionMode):
    """A torch-function mode of the user's: every product times ten."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        return out * 10 if func is torch.Tensor.mul else out


def test_a_torch_function_mode_of_the_users_around_the_call_runs_it_eagerly() -> None:
    """Traced without the mode, called under it, and the other way round: the mode's Python
    was dropped or baked (found by a probe). It is part of the key; under it the call runs
    eagerly, warned, and without it the program is compiled."""

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * 2.0

    for first_under_mode in (False, True):
        jitted, x = ptj.jit(step), torch.ones(2)
        with pytest.warns(ptj.JitWarning, match="torch-function mode of yours .*_TimesTen"):
            for under_mode in (first_under_mode, not first_under_mode, first_under_mode):
                with _TimesTen() if under_mode else contextlib.nullcontext():
                    for _ in range(2):
                        torch.testing.assert_close(jitted(x), step(x))
        assert jitted.num_traces == 2
        assert "torch-function modes _TimesTen" in jitted.explain()


def test_the_default_device_is_part_of_the_cache_key(device: torch.device) -> None:
    """``torch.set_default_device`` (and ``with torch.device(...)``) decide where the step's
    factories make tensors: a compiled program made them where it was traced."""

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.arange(3.0) + x.sum().to(torch.get_default_device())

    jitted = ptj.jit(step)
    x = torch.ones(3)
    try:
        for default in (device, torch.device("meta"), device):
            torch.set_default_device(default)
            for _ in range(2):
                got, want = jitted(x), step(x)
                assert got.device == want.device and got.device.type == default.type
                if default.type != "meta":
                    torch.testing.assert_close(got, want)
    finally:  # as conftest left it: set on CUDA only (else a device mode stays for later tests)
        torch.set_default_device(device if device.type == "cuda" else None)
    with torch.device("meta"):
        assert jitted(x).device.type == "meta"
    assert jitted.num_traces == 2
    assert "default device meta" in jitted.explain()


class _Forcing:
    def __init__(self, amplitude: float) -> None:
        self.amplitude = amplitude

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.amplitude


def test_a_callable_object_argument_is_keyed_by_its_plain_attributes() -> None:
    forcing = _Forcing(1.0)

    def step(x: torch.Tensor, force: Any) -> torch.Tensor:
        return x + force(x)

    jitted = ptj.jit(step)
    x = torch.ones(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for amplitude in (1.0, 1.0, 5.0, 5.0):
            forcing.amplitude = amplitude
            torch.testing.assert_close(jitted(x, forcing), step(x, forcing))
    assert jitted.num_traces == 2


def test_a_changed_attribute_of_a_callable_argument_is_named_as_the_retrace_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    forcing = _Forcing(1.0)
    jitted = ptj.jit(lambda x, force: x + force(x))
    jitted(torch.ones(3), forcing)
    forcing.amplitude = 5.0
    with caplog.at_level("INFO", logger="phi_torch_jit"):
        jitted(torch.ones(3), forcing)
    assert "force: attribute amplitude 1.0 -> 5.0" in caplog.text


def test_a_mutable_default_argument_changed_in_place_is_guarded_by_content() -> None:
    def step(x: torch.Tensor, coefficients: list[float] = [1.0]) -> torch.Tensor:  # noqa: B006
        return x * coefficients[0]

    def change() -> None:
        step.__defaults__[0][0] = 5.0  # type: ignore[index]

    assert _equal_before_and_after(step, change).num_traces == 2


@dataclasses.dataclass(slots=True)
class _Slotted:
    matrix: torch.Tensor


class _Deep:
    def __init__(self, matrix: torch.Tensor) -> None:
        self.inner = types.SimpleNamespace(table={"m": matrix})


def _apply_per_call(a: torch.Tensor, b: torch.Tensor, how: str) -> torch.Tensor:
    """A Function class per call reaching ``a`` by one route (test below)."""
    slotted = _Slotted(a) if how == "slots" else None  # only the route tested holds a
    deep = _Deep(a) if how == "deep" else None
    product = functools.partial(torch.matmul, a) if how == "partial" else None
    default = a if how == "default" else None

    class Product(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, b: torch.Tensor, m: Any = default) -> torch.Tensor:
            matrix = {"slots": lambda: slotted.matrix,  # type: ignore[union-attr]
                      "deep": lambda: deep.inner.table["m"],  # type: ignore[union-attr]
                      "default": lambda: m, "class": lambda: Product.M}.get(how)  # fmt: skip
            return product(b) if matrix is None else matrix() @ b  # type: ignore[misc]

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> Any:
            return g, None

    if how == "class":
        Product.M = a  # type: ignore[attr-defined]
    return Product.apply(b)  # type: ignore[no-untyped-call,no-any-return]


@pytest.mark.parametrize("how", ["slots", "deep", "partial", "default", "class"])
def test_a_per_call_class_reaching_its_tensor_by_any_route_is_never_stale(how: str) -> None:
    """Through ``__slots__``: compiled, the tensor an input. Deeper than the plan looks, bound
    by a partial (a tuple), a default value, a class attribute: eager, one warning."""

    def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _apply_per_call(a, b, how)

    jitted = ptj.jit(step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(1, 4):
            a, b = torch.eye(3) * k, torch.ones(3)
            torch.testing.assert_close(jitted(a, b), step(a, b))
    said = [str(w.message) for w in caught if issubclass(w.category, ptj.JitWarning)]
    assert len(said) == (0 if how == "slots" else 1), said


GAIN = 2.0


def _gain_term(x: torch.Tensor) -> torch.Tensor:
    return x * GAIN


GAIN_TERMS = [_gain_term]


@pytest.mark.parametrize(
    "how", ["generator", "lambda", "comprehension", "inner function", "function in a list"]
)
def test_a_global_read_in_nested_code_or_by_a_function_in_a_list_is_guarded(how: str) -> None:
    """Lambdas, comprehensions (their own code objects on Python 3.11), generator expressions
    and inner functions read the function's globals; so do functions kept in a registry."""

    def inner(x: torch.Tensor) -> torch.Tensor:
        def scaled(y: torch.Tensor) -> torch.Tensor:
            return y * GAIN

        return scaled(x)

    steps = {
        "generator": lambda x: sum(x * GAIN for _ in range(2)),
        "lambda": lambda x: (lambda y: y * GAIN)(x),
        "comprehension": lambda x: sum([x * GAIN for _ in range(2)]),
        "inner function": inner,
        "function in a list": lambda x: sum(t(x) for t in GAIN_TERMS),
    }
    global GAIN

    def change() -> None:
        global GAIN
        GAIN = 5.0

    try:
        assert _equal_before_and_after(steps[how], change).num_traces == 2
    finally:
        GAIN = 2.0


def test_a_partial_held_by_a_module_has_its_keywords_guarded() -> None:
    cfg = types.SimpleNamespace(alpha=0.1)

    def relax(x: torch.Tensor, cfg: Any) -> torch.Tensor:
        return x * cfg.alpha

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.op = functools.partial(relax, cfg=cfg)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.op(x)  # type: ignore[no-any-return]

    net = Net()

    def change() -> None:
        cfg.alpha = 0.9

    assert _equal_before_and_after(net, change).num_traces == 2


class _Stateful:
    """A callable holding a tensor, a list and a class constant."""

    SCALE = 1.0

    def __init__(self) -> None:
        self.weight = torch.ones(3)
        self.coefficients = [1.0, 1.0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight * self.coefficients[1] * self.SCALE


@pytest.mark.parametrize("change", ["tensor rebound", "list in place", "class constant"])
def test_a_callable_arguments_tensors_lists_and_class_constants_are_keyed(change: str) -> None:
    class Force(_Stateful):  # its own class: the class constant changes for this test only
        pass

    force = Force()

    def step(x: torch.Tensor, f: Any) -> torch.Tensor:
        return x + f(x)

    def apply_change() -> None:
        if change == "tensor rebound":
            force.weight = torch.full((3,), 5.0)
        elif change == "list in place":
            force.coefficients[1] = 7.0
        else:
            Force.SCALE = 3.0

    assert _equal_before_and_after(step, apply_change, force).num_traces == 2


class _Outer(torch.autograd.Function):
    """A custom function whose forward makes a per-call class closing over its own values."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _solve(Operator(a * 2), b) + 1

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, g


def test_a_per_call_class_made_inside_a_compiled_forward_is_never_stale() -> None:
    """Compiling ``_Outer``'s forward makes the inner class again, closing over traced values:
    that forward runs as Python (logged), never with the first call's matrix."""

    def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _Outer.apply(a, b)  # type: ignore[no-untyped-call,no-any-return]

    jitted = ptj.jit(step)
    for k in range(1, 5):
        a, b = torch.eye(4) * k, torch.ones(4)
        torch.testing.assert_close(jitted(a, b), step(a, b))
    assert jitted.num_traces == 1


FORCING_QUEUE: collections.deque[float] = collections.deque()
SAMPLES = array.array("d")
HISTORY: tuple[list[float], ...] = ([],)


def _pops_forcing(x: torch.Tensor) -> torch.Tensor:
    return x * FORCING_QUEUE.popleft()


def _appends_a_sample(x: torch.Tensor) -> torch.Tensor:
    SAMPLES.append(float(len(SAMPLES)))
    return x * sum(SAMPLES)


def _appends_to_a_tuples_list(x: torch.Tensor) -> torch.Tensor:
    HISTORY[0].append(1.0)
    return x * len(HISTORY[0])


@pytest.mark.parametrize(
    "step", [_pops_forcing, _appends_a_sample, _appends_to_a_tuples_list],
    ids=["deque.popleft", "array.append", "a tuple's list"],
)  # fmt: skip
def test_a_step_changing_a_deque_array_or_a_tuples_list_it_reads_runs_eagerly_once_per_call(
    step: Any,
) -> None:
    """Containers guarded by content but changed in place by the step: their snapshot before
    the record pass was the container itself (a deque, an array, a tuple's lists), so no change
    was seen; the step retraced on every call, and each trace pass popped or appended once
    more (two items per call)."""
    FORCING_QUEUE.clear()
    FORCING_QUEUE.extend(float(i) for i in range(1, 20))
    del SAMPLES[:]
    HISTORY[0].clear()
    twin_queue, twin_samples, twin_history = collections.deque(FORCING_QUEUE), array.array("d"), []
    jitted = ptj.jit(step)
    with pytest.warns(ptj.JitWarning, match="changes Python state it reads"):
        for call in range(4):
            got = jitted(torch.ones(2))
            twin_samples.append(float(call))
            twin_history.append(1.0)
            wanted = {"_pops_forcing": twin_queue.popleft(), "_appends_a_sample": sum(twin_samples),
                      "_appends_to_a_tuples_list": float(len(twin_history))}  # fmt: skip
            want = wanted[step.__name__]
            torch.testing.assert_close(got, torch.ones(2) * want)


TALLY = np.zeros(1)
BIG_TALLY = np.zeros(5000)  # past the content guard's 4096 elements: guarded by identity


def _tally(x: torch.Tensor) -> torch.Tensor:
    TALLY[0] += 1
    return x * TALLY[0]


def _big_tally(x: torch.Tensor) -> torch.Tensor:
    np.add(BIG_TALLY, 1.0, out=BIG_TALLY)
    return x * float(BIG_TALLY.sum()) / 5000


@pytest.mark.parametrize("step", [_tally, _big_tally])
def test_a_step_writing_a_numpy_array_it_reads_runs_eagerly_once_per_call(step: Any) -> None:
    """``T[0] += 1`` and ``np.add(A, 1, out=A)`` on NumPy arrays the step reads: the snapshot
    before the record pass held the array itself, so no change was seen; every call
    retraced, and each trace pass wrote once more (1, 3, 5 where eager gives 1, 2, 3)."""
    TALLY[:] = 0.0
    BIG_TALLY[:] = 0.0
    jitted = ptj.jit(step)
    with pytest.warns(ptj.JitWarning, match="changes Python state it reads") as caught:
        got = [jitted(torch.ones(2))[0].item() for _ in range(3)]
    assert got == [1.0, 2.0, 3.0]
    assert TALLY[0] + BIG_TALLY[0] == 3.0
    assert sum(issubclass(w.category, ptj.JitWarning) for w in caught) == 1


SIMPLE_QUEUE: queue.SimpleQueue[int] = queue.SimpleQueue()
HASH = hashlib.sha256()
COUNT = ctypes.c_double(0.0)
MAPPED = mmap.mmap(-1, 8 * 6)
MAPPED.write(struct.pack("6d", 1.0, 2.0, 3.0, 4.0, 5.0, 6.0))
PICKLED = io.BytesIO()
for _value in (1.0, 2.0, 3.0, 4.0):
    pickle.dump(_value, PICKLED)
UNPICKLER = pickle.Unpickler(PICKLED)


def _puts(x: torch.Tensor) -> torch.Tensor:
    SIMPLE_QUEUE.put(1)
    return x * SIMPLE_QUEUE.qsize()


def _hashes(x: torch.Tensor) -> torch.Tensor:
    HASH.update(b"step")
    return x * 2.0


def _counts(x: torch.Tensor) -> torch.Tensor:
    COUNT.value += 1.0
    return x * COUNT.value


def _reads_on(x: torch.Tensor) -> torch.Tensor:
    return x * struct.unpack("d", MAPPED.read(8))[0]


def _loads(x: torch.Tensor) -> torch.Tensor:
    return x * UNPICKLER.load()


@pytest.mark.parametrize("step", [_reads_on, _loads], ids=["mmap", "Unpickler"])
def test_a_step_reading_a_stream_a_library_keeps_in_c_runs_eagerly_once_per_call(
    step: Any,
) -> None:
    """An ``mmap`` read from (its bytes stay, its position moves) and a ``pickle.Unpickler``
    loaded from (its stream is in C): each call reads the next value (probe 44b); the
    compiled calls repeated the trace's, without a warning."""
    MAPPED.seek(0)
    PICKLED.seek(0)
    UNPICKLER.__init__(PICKLED)  # type: ignore[misc]  # (anew: reads from the start)
    jitted = ptj.jit(step)
    with pytest.warns(ptj.JitWarning, match="runs eagerly"):
        got = [jitted(torch.ones(2))[0].item() for _ in range(4)]
    assert got == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("step", [_puts, _hashes, _counts], ids=["SimpleQueue", "hash", "ctypes"])
def test_a_step_writing_state_a_library_keeps_in_c_runs_eagerly_once_per_call(step: Any) -> None:
    """A ``queue.SimpleQueue``, a hash, a ``ctypes`` value: their state is in C, out of the
    walk's sight; the record and trace passes wrote twice at the first call, the compiled
    calls never, with no warning (probe 36a). Their bytes, size or digest are compared."""
    while not SIMPLE_QUEUE.empty():
        SIMPLE_QUEUE.get()
    COUNT.value = 0.0
    start = HASH.copy()
    jitted = ptj.jit(step)
    with pytest.warns(ptj.JitWarning, match="changes Python state it reads"):
        got = [jitted(torch.ones(2))[0].item() for _ in range(3)]
    if step is _hashes:
        for _ in range(3):
            start.update(b"step")
        assert HASH.digest() == start.digest()
    else:
        assert got == [1.0, 2.0, 3.0]
        assert SIMPLE_QUEUE.qsize() + COUNT.value == 3.0


class _Sub:
    def __init__(self, k: float) -> None:
        self.k = k


class _Named:
    """Equal by its name: keyed by value, its attributes beside."""

    def __init__(self, name: str, sub: _Sub, weight: torch.Tensor) -> None:
        self.name, self.sub, self.weight = name, sub, weight

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Named) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


def _scaled_by_named(x: torch.Tensor, named: _Named) -> torch.Tensor:
    return x * named.sub.k * named.weight


def test_what_an_argument_keyed_by_value_holds_is_guarded() -> None:
    """Probe round 35d: an argument with an ``__eq__`` of its own is keyed by value and by
    which objects it holds; what those hold (``named.sub.k`` changed in place) was never
    guarded, and a tensor it holds written in place was stale on engine "auto"."""
    named = _Named("a", _Sub(1.0), torch.ones(2))
    jitted, x = ptj.jit(_scaled_by_named), torch.arange(2.0)
    for k in (1.0, 2.0, 3.0):
        named.sub.k = k
        named.weight.fill_(k)
        for _ in range(2):
            torch.testing.assert_close(jitted(x, named), _scaled_by_named(x, named))
            jitted.wait_compiled()
    assert jitted.num_traces == 3


class _Scaled(functools.partial):  # type: ignore[type-arg]
    """A partial of yours that holds state of its own (probe 36a)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **kwargs) * self.scale * type(self).GAIN

    GAIN = 1.0


@pytest.mark.parametrize("held", ["global", "the jitted callable", "an argument"])
def test_a_partial_of_your_class_is_guarded_by_its_own_attributes_and_class(held: str) -> None:
    """Its ``func``, ``args`` and ``keywords`` were guarded, its own attributes, its class's
    and its class's ``__call__`` were not: the compiled calls kept the traced scale."""
    scaled = _Scaled(lambda x: x + 1)
    scaled.scale = 2.0  # type: ignore[attr-defined]
    _Scaled.GAIN = 1.0
    x = torch.arange(1.0, 5.0)
    if held == "global":
        step: Callable[..., Any] = lambda x: scaled(x)  # noqa: E731
        jitted, call = ptj.jit(step), (lambda f: f(x))
    elif held == "the jitted callable":
        step, jitted, call = scaled, ptj.jit(scaled), (lambda f: f(x))
    else:
        step = lambda p, x: p(x)  # noqa: E731
        jitted, call = ptj.jit(step), (lambda f: f(scaled, x))

    def changes() -> list[Callable[[], None]]:
        def scale() -> None:
            scaled.scale = 3.0  # type: ignore[attr-defined]

        def gain() -> None:
            _Scaled.GAIN = 5.0

        return [scale, gain]

    like_eager_after_each(jitted, call, step, changes())
    assert jitted.num_traces == 3


def test_an_optimizers_state_read_by_the_step_is_seen() -> None:
    """``opt.state[p]``: an entry a step adds, one rebound, one written in place (Adam's
    ``exp_avg.lerp_``); before, only ``param_groups`` were walked, and the default engine's
    compiled program held the traced tensor as a constant (probe 36b)."""
    w = nn.Parameter(torch.ones(3))
    sgd = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    adam = torch.optim.Adam([w], lr=0.1)
    w.grad = torch.ones(3)
    adam.step()

    def step(x: torch.Tensor) -> torch.Tensor:
        buffer = sgd.state[w].get("momentum_buffer", torch.zeros(3))
        return x + buffer + adam.state[w]["exp_avg"]

    jitted, x = ptj.jit(step), torch.zeros(3)

    def first_step() -> None:
        w.grad = torch.ones(3)
        sgd.step()

    def rebound() -> None:
        sgd.state[w]["momentum_buffer"] = torch.full((3,), 5.0)

    def in_place() -> None:
        w.grad = torch.ones(3)
        adam.step()

    for change in (lambda: None, first_step, rebound, in_place):
        change()
        for _ in range(3):
            torch.testing.assert_close(jitted(x), step(x))
        jitted.wait_compiled()
        torch.testing.assert_close(jitted(x), step(x))
