"""Cold inductor compiles of engine "auto" in a worker process (engines/_compile_process.py,
engines/_compile_worker.py): which compiles go there, the caller's compile then being a load
from inductor's caches, and every way the worker can fail leaving the compile to the caller.

Only the slow test compiles with inductor (a tiny graph, in the worker, then loaded here);
the others send requests that fail at once, or talk to stand-in workers.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import SETTLE_S, program_of
from torch.fx.experimental.proxy_tensor import make_fx

import phi_torch_jit as ptj
from phi_torch_jit._compat import _vec_isa
from phi_torch_jit.engines import _background, _compile_process, _compile_worker, _warm_starts
from phi_torch_jit.engines import auto as auto_engine
from phi_torch_jit.engines._graph_pickle import graph_bytes, graph_from
from phi_torch_jit.engines.auto import AutoEngine
from phi_torch_jit.engines.compile import Compilable


@pytest.fixture(autouse=True)
def _fresh_worker() -> Iterator[None]:
    """Each test meets no worker left by another, and leaves none behind."""
    _compile_process.stop_worker()
    yield
    assert _background.wait_idle(SETTLE_S), "a background compile did not finish"
    _compile_process.stop_worker()


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh inductor cache directory, as on a new machine."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(_compile_process.ENV_SWITCH, raising=False)
    monkeypatch.setattr(_vec_isa, "_KNOWN", {})
    return tmp_path


def heat(u: torch.Tensor) -> tuple[torch.Tensor]:
    for _ in range(3):
        u = u + 0.1 * (torch.roll(u, 1) - 2 * u + torch.roll(u, -1))
    x = torch.linspace(0, 1, u.shape[-1])  # an op without traced inputs
    return (torch.tanh(u) * x,)


def test_a_graph_is_sent_node_for_node_and_rebuilt_without_running_its_ops() -> None:
    """``pickle`` of a GraphModule traces its code again when loaded, which runs the ops
    without traced inputs: a random draw became a constant. Rebuilt here, it stays a draw,
    and the code is the same text."""

    def noisy(x: torch.Tensor) -> Any:
        return (x * torch.randn(3) + torch.arange(3.0))[1:], x.sum(dim=0, keepdim=True)

    graph = make_fx(lambda x: noisy(x))(torch.randn(3))
    rebuilt = graph_from(graph_bytes(graph))
    assert rebuilt.code == graph.code
    x = torch.randn(3)
    torch.manual_seed(1)
    first = rebuilt(x)
    torch.manual_seed(1)
    torch.testing.assert_close(graph(x), first)
    assert not torch.equal(rebuilt(x)[0], first[0])  # a new draw


def _compilable(fn: Any, *inputs: torch.Tensor, **options: Any) -> Compilable:
    graph = make_fx(lambda *tensors: fn(*tensors))(*inputs)  # no annotations in its code
    return Compilable(graph, inputs, AutoEngine(**options), len(inputs))


def _inductor_counter(name: str) -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"][name])


@pytest.mark.slow
def test_a_cold_compile_runs_in_the_worker_and_the_callers_compile_loads_it(
    cache_dir: Path,
) -> None:
    u = torch.randn(64)
    target = _compilable(heat, u)
    original = target.graph
    compiled_there = _compile_process._WORKER.compiles
    assert _compile_process.compile_ahead(target)
    assert _compile_process._WORKER.compiles == compiled_there + 1
    assert target.graph is not original and target.graph.code == original.code  # as sent
    assert _warm_starts.remembered(target)  # the worker remembered it, in this cache directory
    hits, misses = _inductor_counter("fxgraph_cache_hit"), _inductor_counter("fxgraph_cache_miss")
    program = target.compile()
    assert _inductor_counter("fxgraph_cache_hit") == hits + 1  # a load, not a compile
    assert _inductor_counter("fxgraph_cache_miss") == misses
    torch.testing.assert_close(program(u)[0], heat(u)[0])
    again = _compilable(heat, u)  # a later process's capture of the same step: a warm start
    assert _warm_starts.remembered(again)
    assert not _compile_process.compile_ahead(again)
    assert _compile_process._WORKER.compiles == compiled_there + 1


@pytest.mark.slow
def test_engine_auto_says_its_program_was_compiled_in_the_worker(cache_dir: Path) -> None:
    u = torch.randn(32)
    jitted = ptj.jit(lambda u: heat(u)[0] * 2, engine="auto")
    for _ in range(3):
        jitted(u)
    assert jitted.wait_compiled(SETTLE_S), jitted.explain()
    program = program_of(jitted)
    assert program.tier == "inductor" and program.in_worker, jitted.explain()
    assert "compiled in a worker process" in jitted.explain()
    torch.testing.assert_close(jitted(u), heat(u)[0] * 2)


def _scaled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w


SCALED = ptj.custom_gradient(_scaled, lambda i, o, g: (g[0] * i[1], None), name="scaled")
"""A custom function whose second input gets no gradient (None)."""


@pytest.mark.slow
def test_a_graph_calling_a_custom_functions_op_compiles_in_the_worker(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker defines the op as a stand-in from its contract and asks this process which
    gradients are present; the program loaded here computes eager's values and gradients."""
    asked: list[tuple[Any, ...]] = []
    answer = _compile_process._answer
    monkeypatch.setattr(
        _compile_process, "_answer", lambda *question: asked.append(question) or answer(*question)
    )

    def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = SCALED(torch.sin(x), w)
        return (y * y).sum()

    x = torch.randn(32, dtype=torch.float64, requires_grad=True)
    w = torch.randn(32, dtype=torch.float64)
    jitted = ptj.jit(step, engine="auto", fallback="off")
    for _ in range(3):
        jitted(x, w)
    misses = _inductor_counter("fxgraph_cache_miss")
    assert jitted.wait_compiled(SETTLE_S), jitted.explain()
    program = program_of(jitted)
    assert program.tier == "inductor" and program.in_worker, jitted.explain()
    assert "phi_torch_jit.scaled_" in program.target.graph.code
    assert _inductor_counter("fxgraph_cache_miss") == misses  # loaded here, not compiled
    assert [question[1] for question in asked] == [(True, False)]
    (grad,) = torch.autograd.grad(jitted(x, w), [x])
    (expected,) = torch.autograd.grad(step(x, w), [x])
    torch.testing.assert_close(grad, expected)


def _registered_op() -> Any:
    library = torch.library.Library("ptj_test_process", "FRAGMENT")
    library.define("twice(Tensor x) -> Tensor")
    library.impl("twice", lambda x: 2 * x, "CompositeExplicitAutograd")
    torch.library.register_fake("ptj_test_process::twice", lambda x: torch.empty_like(x))
    return library


_LIBRARY = _registered_op()


def test_only_inductor_compiles_of_cpu_graphs_of_torchs_and_our_ops_go_to_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A graph calling a library's op needs that op registered, which only the caller's
    process has; other backends keep nothing on disk to load; the switch is off."""
    asked: list[bytes] = []
    monkeypatch.setattr(_compile_process._WORKER, "compile", lambda request: asked.append(request))
    u = torch.randn(8)
    others = [
        _compilable(lambda u: (torch.ops.ptj_test_process.twice(u) + 1,), u),
        _compilable(heat, u, backend="aot_eager"),
    ]
    cuda = _compilable(heat, u)
    cuda.metas = [(*meta[:3], torch.device("cuda", 0), meta[4]) for meta in cuda.metas]
    others.append(cuda)
    for target in others:
        graph = target.graph
        assert not _compile_process.compile_ahead(target)
        assert target.graph is graph
    monkeypatch.setenv(_compile_process.ENV_SWITCH, "0")
    assert not _compile_process.compile_ahead(_compilable(heat, u))
    assert not asked


def _stand_in(monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    """Start this script in place of the worker."""
    monkeypatch.setattr(_compile_process, "_BOOT", script)


_READS_A_REQUEST = (  # says its imports are done, as the worker does, then reads requests
    "import pickle, sys\n"
    "pickle.dump({'ready': True}, sys.stdout.buffer); sys.stdout.buffer.flush()\n"
    "def request():\n"
    "    n = int.from_bytes(sys.stdin.buffer.read(8), 'little')\n"
    "    return sys.stdin.buffer.read(n)\n"
)


@pytest.mark.parametrize(
    "script",
    [
        "import sys; sys.exit(3)",
        _READS_A_REQUEST + "request()\nsys.exit(0)",
        _READS_A_REQUEST + "while request():\n"
        "    pickle.dump({'error': 'it failed'}, sys.stdout.buffer); sys.stdout.buffer.flush()\n",
    ],
    ids=["cannot-start", "dies-in-the-compile", "compile-fails"],
)
def test_a_worker_that_fails_leaves_the_compile_to_the_caller(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch, script: str
) -> None:
    _stand_in(monkeypatch, script)
    target = _compilable(heat, torch.randn(8))
    assert not _compile_process.compile_ahead(target)  # the compile thread compiles it then
    assert not _warm_starts.remembered(target)


def test_a_request_the_worker_cannot_compile_is_answered_and_the_worker_goes_on(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real worker: a request that fails there is reported (the caller compiles then), and
    the same worker takes the next request; it runs at a lower CPU priority than the caller
    (by default; the suite sets ``PHI_TORCH_JIT_COMPILE_NICE`` to 0 elsewhere)."""
    monkeypatch.delenv(_compile_worker.NICE_ENV, raising=False)
    broken = pickle.dumps({"target": None, "graph": b"", "settings": {}, "cache_dir": "."})
    assert not _compile_process._WORKER.compile(broken)
    pid = _compile_process.worker_pid()
    assert pid is not None
    assert not _compile_process._WORKER.compile(broken)
    assert _compile_process.worker_pid() == pid
    if hasattr(os, "getpriority"):
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, mine + _compile_worker.NICE)


@pytest.mark.parametrize(("value", "nice"), [("", 10), ("0", 0), (" 5 ", 5), ("19", 19)])
def test_the_workers_priority_can_be_set(
    value: str, nice: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_compile_worker.NICE_ENV, value)
    assert _compile_worker.nice_increment() == nice


@pytest.mark.parametrize("value", ["high", "-1", "20", "2.5"])
def test_a_bad_priority_is_refused_naming_the_variable_and_no_worker_starts(
    value: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(_compile_worker.NICE_ENV, value)
    with pytest.raises(ValueError, match=r"PHI_TORCH_JIT_COMPILE_NICE.*0 to 19"):
        _compile_worker.nice_increment()
    broken = pickle.dumps({"target": None})
    with caplog.at_level("WARNING", logger="phi_torch_jit"):
        assert not _compile_process._WORKER.compile(broken)
    assert _compile_process.worker_pid() is None
    assert "PHI_TORCH_JIT_COMPILE_NICE" in caplog.text


def test_an_idle_worker_ends_by_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_compile_process, "IDLE_EXIT_S", 0.1)
    broken = pickle.dumps({"target": None})
    assert not _compile_process._WORKER.compile(broken)
    process = _compile_process._WORKER.process
    assert process is not None
    assert process.wait(timeout=120) == 0


def test_at_exit_a_compile_waiting_for_the_worker_is_stopped_and_none_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Nothing may compile in-process while the interpreter shuts down (inductor abandoned
    there aborted the process): the wait ends with an error, and later compiles raise."""
    received = tmp_path / "received"
    _stand_in(
        monkeypatch,
        _READS_A_REQUEST + f"request()\nopen({str(received)!r}, 'w').close()\n"
        "import time; time.sleep(600)",
    )
    worker = _compile_process._Worker()
    errors: list[BaseException] = []

    def compile_there() -> None:
        try:
            worker.compile(b"a request")
        except RuntimeError as error:
            errors.append(error)

    thread = threading.Thread(target=compile_there)
    thread.start()
    while not received.exists() and thread.is_alive():  # the worker has the request
        thread.join(0.01)
    worker.close()
    thread.join(60)
    assert not thread.is_alive() and len(errors) == 1, errors
    with pytest.raises(RuntimeError, match="exiting"):
        worker.compile(b"another")
    assert worker.process is None


def test_the_worker_is_started_when_a_program_that_will_use_it_gets_its_fast_tier(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its imports (3-5 s) then overlap the first calls instead of delaying the compile."""
    _stand_in(monkeypatch, "import sys; sys.stdin.read()")  # waits for the caller to end
    u = torch.randn(8)
    _compile_process.start_worker_for(_compilable(heat, u, backend="aot_eager"))
    assert _compile_process.worker_pid() is None
    _compile_process.start_worker_for(_compilable(heat, u))
    assert _compile_process.worker_pid() is not None
    _compile_process.stop_worker()
    started: list[Any] = []
    monkeypatch.setattr(auto_engine, "start_worker_for", started.append)
    jitted = ptj.jit(lambda u: heat(u)[0], engine="auto", fallback="off")
    jitted(u)
    assert [target.graph for target in started] == [program_of(jitted).target.graph]
