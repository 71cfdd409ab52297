"""nn.Module hooks, train/eval and state_dict inside jit, compared with eager (issue 3)."""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import pytest
import torch
from torch import nn

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines


def _net() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def _check_same(step: Any, net: nn.Module, x: torch.Tensor) -> None:
    for _ in range(2):
        assert torch.allclose(step(x), net(x))


@contextmanager
def _python_calls(*functions: Any) -> Iterator[dict[str, int]]:
    """Count the calls of ``functions`` in this thread (a profile function: no state of the
    functions' own, which would be a side effect of the step)."""
    codes = {f.__code__: f.__name__ for f in functions}
    counts = dict.fromkeys(codes.values(), 0)

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code in codes:
            counts[codes[frame.f_code]] += 1

    sys.setprofile(profile)
    try:
        yield counts
    finally:
        sys.setprofile(None)


def test_forward_hooks_of_every_kind_are_compiled_in() -> None:
    net = _net()

    def pre(m: nn.Module, args: Any) -> Any:
        return (args[0] * 2,)

    def post(m: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out + 1

    def with_kwargs(m: nn.Module, args: Any, kwargs: Any, out: torch.Tensor) -> torch.Tensor:
        return out * 3

    def global_hook(m: nn.Module, args: Any, out: Any) -> Any:
        return out - 0.5 if isinstance(m, nn.Tanh) else None

    net[0].register_forward_pre_hook(pre)
    net[0].register_forward_hook(post)
    net[2].register_forward_hook(with_kwargs, with_kwargs=True)
    handle = nn.modules.module.register_module_forward_hook(global_hook)
    try:
        x = torch.randn(3, 4)
        want = net(x)
        step = ptj.jit(net)
        for _ in range(3):  # the record pass, the trace pass; engine "compile" compiles
            assert torch.allclose(step(x), want)
        with _python_calls(pre, post, with_kwargs) as calls:
            for _ in range(2):
                assert torch.allclose(step(x), want)
        assert calls == {"pre": 0, "post": 0, "with_kwargs": 0}  # compiled: no hook Python
    finally:
        handle.remove()
    assert step.num_traces == 1  # the global hook was there for all compiled calls


def test_hooks_that_change_their_own_state_run_eagerly_warned() -> None:
    """A hook counting calls into its output, or collecting activations: compiled calls run
    no hook Python, so the step runs eagerly, warned (it was silently stale, probe round 12)."""

    def make() -> tuple[nn.Module, list[torch.Tensor], dict[str, int]]:
        net, seen, state = _net(), [], {"n": 0}

        def counted(m: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
            state["n"] += 1
            return out * state["n"]

        net[0].register_forward_hook(counted)
        net[2].register_forward_hook(lambda m, args, out: seen.append(out.detach()))
        return net, seen, state

    (net, seen, state), (eager, their_seen, their_state) = make(), make()
    jitted = ptj.jit(net)
    x = torch.ones(2, 4)
    with pytest.warns(ptj.JitWarning, match="changes Python state"):  # on the second call:
        for _ in range(2):  # a first one may fill a cache once
            torch.testing.assert_close(jitted(x), eager(x))
    for _ in range(3):
        torch.testing.assert_close(jitted(x), eager(x))
    assert state == their_state and len(seen) == len(their_seen) == 5


def test_hooks_added_removed_or_replaced_later_retrace() -> None:
    net = _net()
    step = ptj.jit(net)
    x = torch.randn(3, 4)
    _check_same(step, net, x)
    handle = net[2].register_forward_hook(lambda m, a, o: o * 10)
    _check_same(step, net, x)
    assert step.num_traces == 2
    handle.remove()
    _check_same(step, net, x)
    handle = net[2].register_forward_hook(lambda m, a, o: o - 5)  # replaced
    _check_same(step, net, x)
    assert step.num_traces == 3  # the hook-free specialization was reused once removed


def test_guard_hooks_false_ignores_later_hooks_as_documented() -> None:
    net = _net()
    step = ptj.jit(net, guard_hooks=False)
    x = torch.randn(3, 4)
    before = step(x)
    step(x)
    net[2].register_forward_hook(lambda m, a, o: o * 10)
    assert torch.allclose(step(x), before)  # ignored, like skip_nnmodule_hook_guards
    assert step.num_traces == 1
    net.eval()  # training flags are still guarded
    step(x)
    assert step.num_traces == 2


def test_train_eval_switch_retraces_and_reuses() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 1))
    step = ptj.jit(net)
    x = torch.randn(16, 4)
    step(x)
    net.eval()
    _check_same(step, net, x)  # deterministic in eval: no dropout, running stats
    assert step.num_traces == 2
    net.train()
    torch.manual_seed(5)
    got = step(x)
    torch.manual_seed(5)
    assert torch.allclose(got, net(x))
    net.eval()
    _check_same(step, net, x)
    assert step.num_traces == 2  # both specializations stay cached


def test_retrace_reason_names_module_and_change(caplog: pytest.LogCaptureFixture) -> None:
    net = _net()
    step = ptj.jit(net)
    step(torch.randn(2, 4))
    net[1].eval()
    with caplog.at_level(logging.INFO, logger="phi_torch_jit"):
        step(torch.randn(2, 4))
    assert any(
        "module Sequential.1 training True -> False" in r.getMessage() for r in caplog.records
    )


def test_backward_hooks_fire_with_eager_gradients() -> None:
    net = _net()
    log: list[tuple[str, torch.Tensor]] = []

    def full(m: nn.Module, grad_in: Any, grad_out: Any) -> None:
        log.append(("full", grad_in[0].clone()))

    def pre(m: nn.Module, grad_out: Any) -> Any:
        log.append(("pre", grad_out[0].clone()))
        return (grad_out[0] * 2,)  # backward pre-hooks may replace grad_output

    net[2].register_full_backward_hook(full)
    net[2].register_full_backward_pre_hook(pre)
    x = torch.randn(3, 4, requires_grad=True)
    net(x).sum().backward()
    want_log, want_grad = list(log), x.grad.clone()
    step = ptj.jit(net)
    for call in range(2):
        log.clear()
        x.grad = None
        with pytest.warns(ptj.JitWarning, match="backward hooks") if call == 0 else nullcontext():
            step(x).sum().backward()
        assert [kind for kind, _ in log] == ["pre", "full"]
        for (_, got), (_, want) in zip(log, want_log):
            assert torch.allclose(got, want)
        assert torch.allclose(x.grad, want_grad)
    assert "runs eagerly: a module it calls has backward hooks" in step.explain()


def test_backward_hooks_removed_make_the_next_call_compiled() -> None:
    """A specialization that runs eagerly for its modules' backward hooks keeps the module
    guard: the hooks removed, the next call is traced again and compiled (probe 53b: it ran
    eagerly for good). Gradients equal eager's before and after."""
    net, theirs = _net(), _net()
    theirs.load_state_dict(net.state_dict())
    handles = [m[2].register_full_backward_hook(lambda m, gi, go: (gi[0] * 4,))
               for m in (net, theirs)]  # fmt: skip
    step = ptj.jit(lambda x: net(x))
    x = torch.randn(3, 4, requires_grad=True)

    def check() -> None:
        want = torch.autograd.grad(theirs(x).sum(), x)[0]
        got = torch.autograd.grad(step(x).sum(), x)[0]
        torch.testing.assert_close(got, want)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ptj.JitWarning)
        check()
        check()
    assert step.num_traces == 1 and "runs eagerly" in step.explain()
    for handle in handles:
        handle.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        check()
        check()
    assert step.num_traces == 2
    newest, oldest = step.explain().split("\n[1]")  # explain() lists the newest first
    assert "runs eagerly" not in newest and "runs eagerly" in oldest


def test_state_dict_round_trip_and_loaded_weights_are_used() -> None:
    net = _net()
    seen: list[str] = []
    net.register_state_dict_post_hook(lambda m, sd, prefix, local: seen.append("saved"))
    net.register_load_state_dict_post_hook(lambda m, keys: seen.append("loaded"))
    step = ptj.jit(net)
    x = torch.randn(3, 4)
    step(x)
    saved = {k: v.clone() for k, v in net.state_dict().items()}
    other = _net()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1)
    net.load_state_dict(other.state_dict())
    _check_same(step, net, x)
    assert step.num_traces == 1  # loaded in place: no retrace
    net.load_state_dict(saved, assign=True)  # new tensor objects: retrace
    _check_same(step, net, x)
    assert step.num_traces == 2
    assert seen == ["saved", "loaded", "loaded"]


def test_assigning_a_new_parameter_retraces() -> None:
    net = _net()
    step = ptj.jit(lambda x: net(x))
    x = torch.randn(3, 4)
    step(x)
    net[0].weight = nn.Parameter(torch.zeros(4, 4))
    _check_same(step, net, x)
    assert step.num_traces == 2


def test_a_global_hook_changing_inputs_applies_to_the_users_modules_only() -> None:
    """torch's global module hooks run for the user's modules, as eagerly, not for the
    stand-in module the trace calls (it shifted the input a second time, probe round 12)."""
    net = _net()
    shift = nn.modules.module.register_module_forward_pre_hook(lambda m, args: (args[0] + 1,))
    always = nn.modules.module.register_module_forward_hook(
        lambda m, args, out: out - 1 if isinstance(out, torch.Tensor) else None, always_call=True
    )
    try:
        jitted = ptj.jit(lambda x: net(x))
        x = torch.ones(3, 4)
        for _ in range(4):
            torch.testing.assert_close(jitted(x), net(x))
        assert jitted.num_traces == 1
    finally:
        shift.remove()
        always.remove()


class _Double(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


REGISTERS: dict[str, Any] = {
    "a forward hook": lambda net: net[0].register_forward_hook(lambda m, a, out: out * 2),
    "a submodule": lambda net: net.append(_Double()) if len(net) < 6 else None,
    "a buffer": lambda net: net[0].register_buffer(f"b{len(net[0]._buffers)}", torch.ones(1)),
    "a parameter replaced": lambda net: setattr(
        net[0], "bias", nn.Parameter(net[0].bias.detach() + 1)
    ),
}


@pytest.mark.parametrize("register", list(REGISTERS))
def test_a_step_that_registers_on_every_call_runs_eagerly_warned(register: str) -> None:
    """The record pass registers once, the trace pass did again, compiled calls never: the
    trace's registration is taken back out and the step runs eagerly, as eager code does."""

    def make() -> tuple[Any, nn.Sequential]:
        net = _net()

        def step(x: torch.Tensor) -> torch.Tensor:
            REGISTERS[register](net)
            return net(x)

        return step, net

    (step, net), (eager, their_net) = make(), make()
    jitted = ptj.jit(step)
    x = torch.ones(3, 4)
    with pytest.warns(ptj.JitWarning, match="on every run"):  # the trace's undone
        torch.testing.assert_close(jitted(x), eager(x))
    for _ in range(4):
        torch.testing.assert_close(jitted(x), eager(x))
    assert len(net) == len(their_net)
    assert len(net[0]._forward_hooks) == len(their_net[0]._forward_hooks)
    assert len(net[0]._buffers) == len(their_net[0]._buffers)


def test_a_buffer_registered_on_the_first_call_only_compiles() -> None:
    """Registered once (``if not hasattr``): the trace registers nothing more; no warning."""

    class Masked(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not hasattr(self, "mask"):
                self.register_buffer("mask", torch.tril(torch.ones(4, 4)))
            return x @ self.mask

    net, their_net = Masked(), Masked()
    jitted = ptj.jit(net)
    x = torch.ones(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for _ in range(4):
            torch.testing.assert_close(jitted(x), their_net(x))
    assert jitted.num_traces == 1 and not jitted.specializations[0].eager_reason


def _plus_one(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return output + 1.0


def _tripled(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return output * 3.0


def _halved(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return output * 0.5


def test_a_hook_replaced_under_its_key_or_the_hooks_reordered_retraces() -> None:
    """Hooks edited in torch's dicts directly: a function put under an existing key
    (``m._forward_hooks[k] = other``), the order changed (``move_to_end``), on a module and
    among torch's global hooks. The count and the handle counter stay, and the traced hooks
    were replayed (probe round 24); the hooks of the dicts that held some are compared in
    order, with their functions, on every call."""
    from torch.nn.modules import module as torch_module

    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    first = model.register_forward_hook(_plus_one)
    model.register_forward_hook(_tripled)
    global_first = torch_module.register_module_forward_hook(_plus_one)
    global_second = torch_module.register_module_forward_hook(_tripled)
    try:
        jitted = ptj.jit(lambda x: model(x))
        x = torch.randn(2, 3)
        changes = [
            lambda: None,
            lambda: model._forward_hooks.__setitem__(first.id, _halved),
            lambda: model._forward_hooks.move_to_end(first.id),
            lambda: torch_module._global_forward_hooks.move_to_end(global_first.id),
        ]
        _like_the_model_after_each(jitted, model, x, changes)
        assert jitted.num_traces == 4, jitted.explain()
    finally:
        global_first.remove()
        global_second.remove()


def test_a_modules_hook_dicts_replaced_retrace() -> None:
    """A module's hook dicts replaced whole (``m._forward_hooks = OrderedDict()``, a new one
    holding another hook, the pre-hooks' too, the dict of hooks taking keywords): no handle
    is added or removed, and the old dicts, which the guard compared, stay as they were
    (probe 43b). Each dict is compared by identity."""
    from collections import OrderedDict

    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    model.register_forward_hook(_plus_one)
    model.register_forward_pre_hook(lambda m, args: (args[0] * 2.0,))
    jitted = ptj.jit(lambda x: model(x))
    x = torch.randn(2, 3)
    changes = [
        lambda: None,
        lambda: setattr(model, "_forward_hooks", OrderedDict()),
        lambda: setattr(model, "_forward_hooks", OrderedDict({10**6: _tripled})),
        lambda: setattr(model, "_forward_pre_hooks", OrderedDict()),
        lambda: setattr(model, "_forward_hooks_with_kwargs", {}),
    ]
    _like_the_model_after_each(jitted, model, x, changes)
    assert jitted.num_traces == 5, jitted.explain()


def _like_the_model_after_each(jitted: Any, model: nn.Module, x: torch.Tensor,
                               changes: list[Any]) -> None:  # fmt: skip
    """After each change, two calls equal the model's, without a JitWarning."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for change in changes:
            change()
            for _ in range(2):
                torch.testing.assert_close(jitted(x), model(x))


class _GradScale:
    def __init__(self) -> None:
        self.k = 2.0


def test_a_gradient_through_a_hooked_parameter_runs_the_hook_as_eager_does() -> None:
    """A hook on a parameter (``weight.register_hook(lambda g: g * cfg.k)``) runs in a
    gradient the step takes with ``torch.autograd.grad``; the captured gradient left it out,
    on every engine that captures one (probe round 27: the gradient half of eager's, and
    ``cfg.k`` changed between calls never seen). Such a step runs eagerly, warned."""
    cfg = _GradScale()
    lin = nn.Linear(3, 3)
    lin.weight.register_hook(lambda g: g * cfg.k)

    def step(x: torch.Tensor) -> torch.Tensor:
        (grad,) = torch.autograd.grad(lin(x).sum(), lin.weight)
        return grad

    x = torch.linspace(0.5, 1.5, 6).reshape(2, 3)
    jitted = ptj.jit(step)
    with warnings.catch_warnings():  # engine "torchscript": eager, warned
        warnings.simplefilter("ignore", ptj.JitWarning)
        for k in (2.0, 5.0):
            cfg.k = k
            for _ in range(3):
                torch.testing.assert_close(jitted(x), step(x))
    if "torchscript" not in jitted.explain():
        assert "through a tensor with a hook (register_hook" in jitted.explain()


def _doubled_on_unpack(t: torch.Tensor) -> torch.Tensor:
    return t * 2  # a saved tensor doubled: the gradient shows whether the hook ran


def _hooked_inside(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, _doubled_on_unpack):
        return (x * w).sin().sum()


def _plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x * w).sin().sum()


@pytest.mark.parametrize("around", [False, True], ids=["inside the step", "around the call"])
def test_saved_tensor_hooks_run_as_eagerly_and_the_step_is_warned_eager(around: bool) -> None:
    """Saved-tensor hooks (``saved_tensors_hooks``, ``save_on_cpu``) unpack in the backward,
    which a compiled program's backward does not call: entered in the step or active around
    the call, the gradient was the unhooked one from the second call on, on every engine,
    unwarned (guarded.md's honest list until session 29). Such calls run eagerly, warned
    once; a non-reentrant checkpoint's own hooks do not count."""
    step = _plain if around else _hooked_inside
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, _doubled_on_unpack)
    jitted = ptj.jit(step)
    x = torch.linspace(0.5, 1.5, 3)
    w = torch.linspace(-1.0, 1.0, 3, requires_grad=True)

    def gradient(fn: Any) -> torch.Tensor:
        w.grad = None
        with hooks if around else nullcontext():
            fn(x, w).backward()
        assert w.grad is not None
        return w.grad.clone()

    want = gradient(step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            torch.testing.assert_close(gradient(jitted), want)
            jitted.wait_compiled()
    said = [str(w.message) for w in caught if issubclass(w.category, ptj.JitWarning)]
    assert len(said) == 1 and "saved-tensor hooks" in said[0], said
    w.grad = None
    _plain(x, w).backward()
    assert w.grad is not None and not torch.allclose(want, w.grad)  # the hook mattered


HOOK_SCALE = [2.0]


class _ScalingHook:
    def __init__(self) -> None:
        self.s = 2.0

    def __call__(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return output * self.s


@pytest.mark.parametrize("kind", ["function", "object"])
def test_the_hooks_of_a_module_the_step_reads_but_does_not_call_are_walked(kind: str) -> None:
    """The step calls a module's hooks itself (``for h in m._forward_hooks.values()``): what
    they read was not guarded, as the record pass saw no call of the module (probe 49)."""
    from helpers import like_eager_then_retraced

    module = nn.Linear(3, 3)
    holder = _ScalingHook()
    module.register_forward_hook(
        holder if kind == "object" else (lambda m, i, o: o * HOOK_SCALE[0])
    )

    def step(x: torch.Tensor) -> torch.Tensor:
        for hook in module._forward_hooks.values():
            x = hook(module, (x,), x)
        return x

    def change() -> None:
        HOOK_SCALE[0] = 5.0
        holder.s = 5.0

    try:
        like_eager_then_retraced(ptj.jit(step), step, change)
    finally:
        HOOK_SCALE[0] = 2.0
