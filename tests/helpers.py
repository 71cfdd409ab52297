"""Shared test fixtures: a 1-D implicit diffusion solve with a hand-written gradient."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from phi_torch_jit._warnings import TORCHSCRIPT_NOTICE
from phi_torch_jit.engines.auto import TieredProgram

SETTLE_S = 900.0
"""How long a test waits at most for the background compiles of its own or of an earlier
test to finish: a net for a compile that hangs, never a time a test depends on (inductor's
compiles took over 120 s, the earlier limit, with two test processes on a loaded 2-core
machine, 2026-12-02)."""


def engine_name(jit_engine: str) -> str:
    """The engine's name (``explain()`` shows it) for a spec of the shared suite's ENGINES."""
    name = jit_engine.partition(":")[0]
    return "auto" if name.startswith("auto") else name


def captures_graph(jit_engine: str) -> bool:
    """Whether the engine of a spec captures an FX graph (engines compile and auto)."""
    return engine_name(jit_engine) in ("compile", "auto")


def value_loop_mode(jitted: Any) -> str:
    """How a jitted function's custom body runs whose loop exits on tensor values and that
    TorchScript cannot script: as compiled blocks where the engine captures loops (engines
    compile and auto, unless ``loops=False``: docs/loops.md), else as Python."""
    engine = jitted.engine
    loops = getattr(engine, "options", {}).get("loops", True)
    return "looped" if engine.name in ("compile", "auto") and loops else "python"


def torchscript_bodies(jitted: Any) -> bool:
    """Whether a jitted function's custom-function bodies are compiled by TorchScript: engine
    "torchscript", or engine "compile" with its default ``functions`` engine, where TorchScript
    works. Otherwise (engine "auto", no TorchScript) they are captured graphs, or Python."""
    from phi_torch_jit._compat import torchscript_available
    from phi_torch_jit.engines.torchscript import TorchScriptEngine

    functions = getattr(jitted.engine, "functions", jitted.engine)
    return isinstance(functions, TorchScriptEngine) and torchscript_available()


class Counter:
    """Counts calls of the Python functions under test: test instrumentation, not state of
    the program under test. Its class names a module without a file (as a library's class
    would), so attribute-path guards and the side-effect check leave it alone."""

    __slots__ = ("forward", "gradient")

    def __init__(self) -> None:
        self.forward = 0
        self.gradient = 0


Counter.__module__ = "builtins"  # not the user's class (_reads._code_walk.user_class)


def laplace(u: torch.Tensor) -> torch.Tensor:
    return torch.roll(u, 1, -1) - 2 * u + torch.roll(u, -1, -1)


def operator(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """A = I - k * Laplace: symmetric positive definite for k >= 0."""
    return x - k * laplace(x)


def cg_loop(b: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Conjugate gradients with a residual-based stopping rule (scriptable)."""
    x = torch.zeros_like(b)
    r = b.clone()
    p = r.clone()
    rs = (r * r).sum()
    tol = 1e-20 if b.dtype == torch.float64 else 1e-12
    it = 0
    while bool(rs > tol) and it < 500:
        ap = p - k * (torch.roll(p, 1, -1) - 2 * p + torch.roll(p, -1, -1))
        alpha = rs / (p * ap).sum()
        x = x + alpha * p
        r = r - alpha * ap
        rs_new = (r * r).sum()
        p = r + rs_new / rs * p
        rs = rs_new
        it += 1
    return x


def make_solve(
    counter: Counter | None = None, scriptable: bool = True, adjoint_via_solve: bool = False
) -> Any:
    """A custom function solving A(k) x = b, differentiable in b and k (implicitly).

    With ``adjoint_via_solve`` the gradient calls the custom function itself for
    the adjoint solve (as implicit solvers usually do); otherwise the plain loop.
    """
    import phi_torch_jit as ptj

    counter = counter or Counter()
    solve: Any = None

    def solve_python(b: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        counter.forward += 1
        return cg_loop(b, k)

    def gradient(inputs: Any, outputs: Any, grads: Any) -> tuple[Any, ...]:
        counter.gradient += 1
        _, k = inputs
        (x,) = outputs
        (g,) = grads
        # A is symmetric: the adjoint solve uses A itself
        lam = solve(g, k) if adjoint_via_solve else cg_loop(g, k)
        grad_k = (lam * laplace(x)).sum().reshape(k.shape)
        return lam, grad_k

    forward = cg_loop if scriptable else solve_python
    solve = ptj.custom_gradient(forward, gradient, name="solve")
    return solve


def seeded(seed: int) -> torch.Generator:
    """A generator seeded with ``seed`` on the device tensors are made on (``torch.Generator()``
    is a CPU one, which draws for CUDA tensors refuse under ``make test-cuda``)."""
    return torch.Generator(device=torch.get_default_device()).manual_seed(seed)


def gradcheck(fn: Any, inputs: tuple[torch.Tensor, ...]) -> bool:
    """``torch.autograd.gradcheck``, which runs backward with ``retain_graph=True``.

    torch.compile refuses that for backwards with donated buffers unless
    ``torch._functorch.config.donated_buffer`` is False (docs/engines.md); engine "compile"
    inherits the rule, so the check is switched off here as a user would.
    """
    import torch._functorch.config  # not imported by torch itself since 2.15

    with torch._functorch.config.patch(donated_buffer=False):
        return bool(torch.autograd.gradcheck(fn, inputs))


def gradgradcheck(fn: Any, inputs: tuple[torch.Tensor, ...]) -> bool:
    """``torch.autograd.gradgradcheck``, with donated buffers off as :func:`gradcheck`."""
    import torch._functorch.config

    with torch._functorch.config.patch(donated_buffer=False):
        return bool(torch.autograd.gradgradcheck(fn, inputs))


@contextmanager
def phiml_eager() -> Iterator[None]:
    """Run reference PhiML/PhiFlow code eagerly without torch's TorchScript notice.

    PhiML calls ``torch.jit.script`` inside its own functions, which warns (FutureWarning)
    since torch 2.15. That is PhiML's eager behaviour, not ours: only the eager reference
    runs of a test are wrapped in this; jitted calls must not let the notice through at all.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", TORCHSCRIPT_NOTICE, Warning)
        yield


def parameter_grads(f: Any, module: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor | None]:
    """The gradients ``f(x).backward()`` leaves on ``module``'s parameters (None: none)."""
    module.zero_grad(set_to_none=True)
    f(x).backward()
    return [None if p.grad is None else p.grad.clone() for p in module.parameters()]


def assert_grads_like_eager(jitted: Any, eager: Any, module: torch.nn.Module, x: Any) -> None:
    """The jitted function leaves the gradients (and the None ones) that eager code leaves."""
    got, want = parameter_grads(jitted, module, x), parameter_grads(eager, module, x)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None and w is not None:
            torch.testing.assert_close(g, w)


def lstm_pair(seed: int) -> list[torch.nn.LSTM]:
    """Two LSTMs with the same weights: one for the jitted function, one for eager code."""
    torch.manual_seed(seed)
    lstms = [torch.nn.LSTM(4, 8, batch_first=True), torch.nn.LSTM(4, 8, batch_first=True)]
    lstms[1].load_state_dict(lstms[0].state_dict())
    return lstms


def program_of(jitted: Any) -> TieredProgram:
    """The tiered program of engine "auto" behind a jitted function's one specialization."""
    (specialization,) = jitted.specializations
    program = specialization.program
    assert isinstance(program, TieredProgram)
    return program


def like_eager_after_each(
    jitted: Any, call: Callable[[Any], Any], eager: Any, changes: Sequence[Callable[[], None]]
) -> None:
    """``call(jitted)`` like ``call(eager)`` three times, then after ``wait_compiled``, before
    any change and after each of ``changes``."""
    for change in [lambda: None, *changes]:
        change()
        for _ in range(3):
            torch.testing.assert_close(call(jitted), call(eager))
        jitted.wait_compiled()
        torch.testing.assert_close(call(jitted), call(eager))


def like_eager_then_retraced(
    jitted: Any, eager: Any, change: Any, traces: int = 2, x: torch.Tensor | None = None
) -> None:
    """Three calls, ``change()``, three calls: each like eager (after ``wait_compiled`` too),
    no JitWarning, and ``traces`` traces in all (the change retraced once)."""
    from phi_torch_jit import JitWarning

    x = torch.linspace(0.5, 1.5, 3) if x is None else x
    with warnings.catch_warnings():
        warnings.simplefilter("error", JitWarning)
        for each in (lambda: None, change):
            each()
            for _ in range(3):
                torch.testing.assert_close(jitted(x), eager(x))
            jitted.wait_compiled()
            torch.testing.assert_close(jitted(x), eager(x))
    assert jitted.num_traces == traces, jitted.explain()
