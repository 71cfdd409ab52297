"""Engine "compile": backends, opaque custom calls, no graph breaks, inductor end to end.

The shared suite (modules marked ``all_engines``) already runs every core behaviour with
``compile:aot_eager``; this module covers what is specific to the engine. Inductor itself
compiles C++ and takes seconds: its tests are marked slow and kept to a few.
"""

from __future__ import annotations

import logging
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from functorch.compile import make_boxed_func
from helpers import Counter, assert_grads_like_eager, cg_loop, lstm_pair, make_solve
from test_function import SavesDependingOnValue
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

import phi_torch_jit as ptj
from phi_torch_jit.engines.compile import CompileEngine


class CGFunction(torch.autograd.Function):
    """A plain autograd.Function with a data-dependent loop: raw torch.compile breaks on it."""

    @staticmethod
    def forward(ctx: Any, b: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        x = cg_loop(b, k)
        ctx.save_for_backward(x, k)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, k = ctx.saved_tensors
        lam = cg_loop(g, k)
        lap = torch.roll(x, 1, -1) - 2 * x + torch.roll(x, -1, -1)
        return lam, (lam * lap).sum().reshape(k.shape)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 4, 3, padding=1)
        self.norm = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.2)
        self.out = nn.Conv1d(4, 1, 3, padding=1)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.norm(self.conv(u[:, None]))))
        return self.out(h)[:, 0]


def unrolled_loss(net: Net, u: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    for _ in range(3):
        u = CGFunction.apply(u, k)
        u = u + 0.1 * net(u)
    return (u**2).mean()


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def test_backend_names_callables_and_options_are_checked_at_jit_time() -> None:
    with pytest.raises(ValueError, match=r"unknown torch.compile backend 'nope'.*'inductor'"):
        ptj.jit(torch.sin, engine="compile", backend="nope")
    with pytest.raises(TypeError, match=r"backend must be a torch.compile backend name"):
        ptj.jit(torch.sin, engine="compile", backend=3)
    with pytest.raises(TypeError, match="engine 'torchscript' does not take option"):
        ptj.jit(torch.sin, engine="torchscript", backend="inductor")
    with pytest.raises(TypeError, match=r"unknown torch.compile option\(s\) \['fulgraph'\]"):
        ptj.jit(torch.sin, engine="compile", fulgraph=True)
    with pytest.raises(TypeError, match="pass them to the engine's constructor"):
        ptj.jit(torch.sin, engine=CompileEngine(), mode="max-autotune")
    engine = ptj.jit(torch.sin, engine="compile", backend="aot_eager", fullgraph=True).engine
    assert isinstance(engine, CompileEngine) and engine.backend == "aot_eager"
    assert engine.options["fullgraph"] is True and engine.options["dynamic"] is False
    with pytest.raises(ptj.ConfigurationError, match="dynamic=True is not supported"):
        ptj.jit(torch.sin, engine="compile", dynamic=True)


def test_environment_picks_the_default_engine_and_backend(monkeypatch: Any) -> None:
    monkeypatch.setenv("PHI_TORCH_JIT_ENGINE", "compile:aot_eager")
    engine = ptj.jit(torch.sin).engine
    assert isinstance(engine, CompileEngine) and engine.backend == "aot_eager"
    assert ptj.jit(torch.sin, engine="torchscript").engine.name == "torchscript"
    monkeypatch.setenv("PHI_TORCH_JIT_ENGINE", "jax")
    with pytest.raises(ValueError, match="unknown engine 'jax'"):
        ptj.jit(torch.sin)


@pytest.mark.uses_torchscript  # engine "compile": TorchScript compiles its custom-function bodies
def test_callable_backend_sees_one_graph_with_each_custom_call_as_one_opaque_node() -> None:
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    counter = Counter()
    solve = make_solve(counter, scriptable=False)  # a Python loop inside: opaque anyway
    # loops=False: the loop of the function the forward calls would be compiled by the same
    # backend as blocks, more graphs than the one asked about here (tests/test_loops.py)
    step = ptj.jit(lambda b, k: solve(b * 2, k) + 1, engine="compile", backend=backend, loops=False)
    b, k = torch.randn(16), torch.tensor(0.3)
    step(b, k)
    calls_before = counter.forward
    for scale in (1.0, 0.0):  # a zero right-hand side: the loop must not be baked (no NaN)
        assert torch.equal(step(b * scale, k), solve(b * scale * 2, k) + 1)
    (gm,) = graphs
    ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert sum("phi_torch_jit.solve" in op for op in ops) == 1, ops
    assert counter.forward == calls_before + 4  # 2 compiled calls + 2 eager references


@pytest.mark.uses_torchscript  # engine "compile": TorchScript compiles its custom-function bodies
def test_registered_and_aot_autograd_backends_compile_forward_and_backward_in_the_first_call() -> (
    None
):
    compiled: list[str] = []

    def fw(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        compiled.append("forward")
        return make_boxed_func(gm.forward)

    def bw(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        compiled.append("backward")
        return make_boxed_func(gm.forward)

    torch._dynamo.register_backend(aot_autograd(fw_compiler=fw, bw_compiler=bw), "ptj_test_aot")
    assert "ptj_test_aot" in torch._dynamo.list_backends(exclude_tags=())
    solve = make_solve()
    lin = nn.Linear(8, 8)

    def step(b: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return solve(lin(b), k)

    jitted = ptj.jit(step, engine="compile", backend="ptj_test_aot")
    b, k = torch.randn(8), torch.tensor(0.4, requires_grad=True)
    jitted(b, k)  # no backward yet: AOTAutograd would wait for one to compile it
    # the statements before the solver's loop (a graph without grad), its block, then ours
    assert compiled == ["forward", "forward", "forward", "backward"]
    got = torch.autograd.grad(jitted(b, k).sum(), [k, lin.weight])
    want = torch.autograd.grad(step(b, k).sum(), [k, lin.weight])
    # and at the first backward, the statements before the loop in the solver's gradient
    # function, then its block
    assert compiled == ["forward", "forward", "forward", "backward", "forward", "forward"]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_a_parameter_frozen_or_unfrozen_after_the_compile_retraces_with_eager_gradients() -> None:
    torch.manual_seed(2)
    net = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
    jitted = ptj.jit(lambda x: net(x).sum(), engine="compile", backend="aot_eager")
    x = torch.randn(3, 6)

    def check() -> None:
        assert_grads_like_eager(jitted, lambda x: net(x).sum(), net, x)

    check()
    net[0].weight.requires_grad_(False)  # frozen: the compiled backward would still compute it
    check()
    assert jitted.num_traces == 2
    net[0].weight.requires_grad_(True)  # back: the first specialization serves again
    check()
    check()
    assert jitted.num_traces == 2


@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")  # dynamo
@pytest.mark.filterwarnings("ignore:The .grad attribute:UserWarning")  # dynamo, raw compile
@pytest.mark.uses_torchscript  # engine "compile": TorchScript compiles its custom-function bodies
def test_autograd_function_with_a_loop_causes_no_graph_break_unlike_raw_torch_compile() -> None:
    torch._dynamo.reset()
    net = Net().eval()
    u, k = torch.randn(4, 16), torch.tensor(0.3, requires_grad=True)
    before = _graph_breaks()
    raw = torch.compile(unrolled_loss, backend="aot_eager")
    raw(net, u, k)
    raw_breaks = _graph_breaks() - before
    assert raw_breaks > 0  # the motivation: dynamo breaks the graph at the CG loop

    jitted = ptj.jit(unrolled_loss, engine="compile", backend="aot_eager")
    before = _graph_breaks()
    jitted(net, u, k)
    for _ in range(2):
        torch.testing.assert_close(jitted(net, u, k), unrolled_loss(net, u, k))
    assert _graph_breaks() == before
    assert "called on the captured graph: compiled in" in jitted.explain()


@pytest.mark.uses_torchscript  # engine "compile": TorchScript compiles its custom-function bodies
def test_python_forward_with_other_ctx_values_than_compiled_raises_instead_of_wrong_grads() -> None:
    step = ptj.jit(lambda x: SavesDependingOnValue.apply(x) * 2, engine="compile")
    step(torch.ones(3))  # compiled with ctx.factor == 3
    x = torch.full((3,), 2.0, requires_grad=True)
    step(x).sum().backward()  # same ctx values: the compiled backward op serves it
    assert torch.equal(x.grad, torch.full((3,), 6.0))
    with pytest.raises(ptj.TraceError, match=r"SavesDependingOnValue.*engine='torchscript'"):
        step(-torch.ones(3))  # ctx.factor would be 1: refused, not silently wrong


def test_tensor_in_a_plain_object_requiring_grad_is_a_program_input() -> None:
    holder = SimpleNamespace(w=torch.randn(3, requires_grad=True))
    step = ptj.jit(lambda x: x * holder.w, engine="compile", backend="aot_eager")
    step(torch.ones(3))
    step(torch.ones(3)).sum().backward()
    assert torch.equal(holder.w.grad, torch.ones(3)) and step.num_traces == 1
    assert "runs eagerly" not in step.explain()


@pytest.mark.slow
@pytest.mark.uses_torchscript  # engine "compile": TorchScript compiles its custom-function bodies
def test_inductor_training_matches_eager_with_dropout_batchnorm_and_optimizer_steps() -> None:
    """Inductor end to end: 3 SGD steps through 3 unrolled CG solves with a CNN in train mode."""
    torch.manual_seed(1)
    nets = [Net(), Net()]
    nets[1].load_state_dict(nets[0].state_dict())
    optimizers = [torch.optim.SGD(n.parameters(), lr=0.1) for n in nets]
    jitted = ptj.jit(unrolled_loss, engine="compile")  # inductor
    u, k = torch.randn(4, 16), torch.tensor(0.3, requires_grad=True)
    for _ in range(3):
        losses = []
        for net, optimizer, fn in zip(nets, optimizers, (jitted, unrolled_loss)):
            torch.manual_seed(7)  # same dropout masks (engine sets fallback_random)
            optimizer.zero_grad()
            loss = fn(net, u, k)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1])
    for a, b in zip(nets[0].state_dict().values(), nets[1].state_dict().values()):
        torch.testing.assert_close(a, b)  # parameters and BatchNorm running stats
    assert jitted.num_traces == 1
    assert "called on the captured graph: compiled in" in jitted.explain()


def test_lstm_training_is_compiled_and_matches_eager(caplog: pytest.LogCaptureFixture) -> None:
    """torch's LSTM decomposition picks oneDNN's inference-only op while the weights train
    (AOTAutograd's program then failed when it ran, and the graph ran uncompiled): the backend
    gets the time steps as ops (``_rnn_layers.lstms_unrolled``)."""
    lstms = lstm_pair(seed=2)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in lstms]

    def loss_of(lstm: nn.LSTM) -> Any:
        def loss(x: torch.Tensor) -> torch.Tensor:
            return lstm(x)[0][:, -1].square().mean()

        return loss

    jitted = ptj.jit(loss_of(lstms[0]), engine="compile", backend="aot_eager")
    eager = loss_of(lstms[1])
    with caplog.at_level(logging.WARNING, logger="phi_torch_jit"):
        for _ in range(3):
            x = torch.randn(2, 5, 4)
            for fn, optimizer in zip((jitted, eager), optimizers):
                optimizer.zero_grad()
                fn(x).backward()
                optimizer.step()
            for a, b in zip(lstms[0].parameters(), lstms[1].parameters()):
                assert torch.allclose(a, b, atol=1e-6)
    notes = " ".join(jitted.specializations[0].engine_notes)
    assert "compiled in" in notes and "uncompiled" not in notes, notes
    assert not [r.message for r in caplog.records if "failed" in r.message]


def test_a_tensor_used_as_a_size_is_a_guarded_value(caplog: pytest.LogCaptureFixture) -> None:
    """``x.repeat(n)`` reads ``n`` inside the op (C++): the capture bakes it and guards it
    (it ran eagerly before); with value guards off, the function runs eagerly and says so."""
    step = ptj.jit(lambda x, n: x.repeat(n), engine="compile", backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for n in (2, 2, 3, 2):
            assert torch.equal(step(torch.ones(2), torch.tensor(n)), torch.ones(2 * n))
    assert step.num_traces == 2
    assert not [s for s in step.specializations if s.eager_reason]
    unguarded = ptj.jit(
        lambda x, n: x.repeat(n), engine="compile", backend="aot_eager", on_guard_failure="off"
    )
    with caplog.at_level(logging.WARNING, logger="phi_torch_jit"):
        with pytest.warns(ptj.JitWarning, match="value guards are off") as warned:
            for n in (2, 3):
                assert torch.equal(unguarded(torch.ones(2), torch.tensor(n)), torch.ones(2 * n))
    assert len(warned) == 1


def _counting_backend() -> tuple[list[torch.fx.GraphModule], Any]:
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    return graphs, backend


def _signed(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if bool(x.sum() > 0) else x - 1


def test_a_value_guarded_specialization_compiles_once_its_path_is_taken_again() -> None:
    """A path of values may never repeat (NOTE [values that never repeat]): the backend
    compiles it only after it served REUSE calls; calls on the other path do not count."""
    from phi_torch_jit.engines.compile import REUSE

    graphs, backend = _counting_backend()
    step = ptj.jit(_signed, engine="compile", backend=backend, fallback="off")
    positive, negative = torch.ones(3), -torch.ones(3)
    assert torch.equal(step(positive), _signed(positive))  # record pass, no compile
    assert torch.equal(step(negative), _signed(negative))  # the positive program: guard fails
    assert graphs == []
    for _ in range(REUSE):
        assert torch.equal(step(positive), _signed(positive))
    assert graphs == []  # served uncompiled so far
    assert torch.equal(step(positive), _signed(positive))
    assert len(graphs) == 1
    assert "compiles after this specialization served" in step.explain()


def test_a_loop_unrolled_by_values_is_never_compiled() -> None:
    from phi_torch_jit.engines.compile import UNROLLED

    def until(x: torch.Tensor) -> torch.Tensor:
        for _ in range(UNROLLED + 10):
            if bool(x.abs().max() < 1e-3):
                break
            x = x * 0.9  # more iterations than UNROLLED before it breaks
        return x

    graphs, backend = _counting_backend()
    step = ptj.jit(until, engine="compile", backend=backend, fallback="off")
    x = torch.ones(3)
    for _ in range(5):
        assert torch.equal(step(x), until(x))
    assert graphs == [] and step.num_traces == 1
    assert "not compiled: its traced Python branched on" in step.explain()


def _tanh_net_loss(net: nn.Module) -> Any:
    def loss(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(net(x)).square().mean()

    return loss


def _spy_on_compile_fx(monkeypatch: pytest.MonkeyPatch, fail_cpp: bool) -> list[dict[str, Any]]:
    """Record the settings each inductor compile gets; with ``fail_cpp``, one with the C++
    wrapper raises as an unsupported graph would."""
    import phi_torch_jit._compat._inductor as inductor_compat

    real = inductor_compat.COMPILE_FX.find()
    seen: list[dict[str, Any]] = []

    def compile_fx(*args: Any, config_patches: dict[str, Any], **kwargs: Any) -> Any:
        seen.append(dict(config_patches))
        if fail_cpp and config_patches.get("cpp_wrapper"):
            raise NotImplementedError("no C++ wrapper for this graph")
        return real(*args, config_patches=config_patches, **kwargs)

    monkeypatch.setattr(inductor_compat, "COMPILE_FX", SimpleNamespace(find=lambda: compile_fx))
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("fail_cpp", [False, True], ids=["cpp-wrapper", "cpp-fails"])
def test_cpu_graphs_compile_with_the_cpp_wrapper_and_fall_back_to_python_where_it_fails(
    monkeypatch: pytest.MonkeyPatch, fail_cpp: bool
) -> None:
    """The C++ wrapper serves CPU graphs (it pays on steps of many small kernels); a graph it
    cannot wrap is compiled again with the Python wrapper, not left uncompiled."""
    seen = _spy_on_compile_fx(monkeypatch, fail_cpp)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    jitted, x = ptj.jit(_tanh_net_loss(net), engine="compile"), torch.randn(16, 3)
    for _ in range(2):
        assert_grads_like_eager(jitted, _tanh_net_loss(net), net, x)
    assert [s.get("cpp_wrapper") for s in seen] == ([True, None] if fail_cpp else [True])
    assert "called on the captured graph: compiled in" in jitted.explain()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["options", "process"])
def test_a_cpp_wrapper_the_user_sets_keeps_the_backward(where: str) -> None:
    """With a C++ wrapper inductor reads the example inputs from the graph's placeholders: the
    capture's fakes there did not require grad, so the program had no backward and its output
    silently required no grad (parameters never trained)."""
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    options = {"options": {"cpp_wrapper": True}} if where == "options" else {}
    jitted, x = ptj.jit(_tanh_net_loss(net), engine="compile", **options), torch.randn(16, 3)
    with inductor_config.patch(cpp_wrapper=where == "process"):
        for _ in range(2):
            assert jitted(x).requires_grad
            assert_grads_like_eager(jitted, _tanh_net_loss(net), net, x)
    assert jitted.num_traces == 1


@pytest.mark.slow
def test_the_cpp_wrapper_compiles_an_advection_step_without_notices_to_the_user(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``grid_sampler_2d`` (kept undecomposed on the CPU) has no C shim: inductor says so at
    WARNING on every compile with the C++ wrapper; nothing a user can act on, so not shown.
    With ``CI`` set, as CI services set it, inductor refused to fall back to an op that has a
    decomposition, and every compile of an advection step failed (found by our own CI)."""
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("CI", "true")

    def advect(field: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.grid_sample(field, grid, align_corners=True) * 2

    jitted = ptj.jit(advect, engine="compile")
    field, grid = torch.randn(1, 1, 8, 8), torch.rand(1, 8, 8, 2) * 2 - 1
    with inductor_config.patch(force_disable_caches=True), caplog.at_level(logging.INFO):
        for _ in range(2):
            torch.testing.assert_close(jitted(field, grid), advect(field, grid))
    report = jitted.explain()
    logged = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO)
    assert "called on the captured graph: compiled in" in report, f"{report}\n{logged}"
    assert not [r for r in caplog.records if "c-shim" in r.getMessage()]


_TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


@pytest.mark.slow
@pytest.mark.xfail(
    _TORCH < (2, 13), strict=True, reason="torch 2.11's inductor ignores emulate_precision_casts "
    "in its CPU kernels (1e-3 off eager's; docs/engines.md)"
)  # fmt: skip
def test_inductor_rounds_where_the_step_casts_to_a_narrower_dtype_as_eager_does() -> None:
    """Probe 42b: ``(lin(x).to(torch.bfloat16) / 3).float()`` was computed in float32 by the
    fused kernel (4e-3 off eager's); the engines give inductor ``emulate_precision_casts``."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    step = lambda x: (lin(x).to(torch.bfloat16) / 3).float()  # noqa: E731
    jitted = ptj.jit(step, engine="compile")  # inductor
    for n in range(1, 4):
        x = torch.linspace(-1, 1, 8).reshape(2, 4) * n
        torch.testing.assert_close(jitted(x), step(x), rtol=0, atol=0)
    assert "called on the captured graph: compiled in" in jitted.explain()


def test_making_a_jitted_function_imports_no_compiler() -> None:
    """``jit(f)`` with the default engine, or engine "compile" with inductor, imported
    inductor (with dynamo, 1-2 s of every process's first ``jit()``), which engine
    "torchscript" never paid; the first compile imports it now (session 41). In a fresh
    process, so that no other test imported it first."""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import sys, warnings
        warnings.simplefilter("error")  # torch.jit's notice at inductor's import: none
        import torch, phi_torch_jit as ptj
        made = [ptj.jit(lambda x: x * 2), ptj.jit(lambda x: x * 3, engine="compile"),
                ptj.jit(lambda x: x * 4, engine="compile", backend="aot_eager")]
        print("torch._inductor.compile_fx" in sys.modules)
        f = ptj.jit(lambda x: x + 1, engine="compile")  # inductor, in the first call
        assert torch.equal(f(torch.ones(2)), torch.full((2,), 2.0))
        print("torch._inductor.compile_fx" in sys.modules)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PHI_TORCH_JIT_ENGINE"}  # the default
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]
