"""Warm starts: what a process keeps on disk for the next one (engines/_warm_starts.py, and
_compat/_vec_isa.py), and engine "auto" serving a remembered program from the second call.

Backends here are small callables except in the one slow test, which compiles a tiny graph with
inductor twice into a fresh cache directory, as a second process of the same script would.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import SETTLE_S, program_of
from torch.fx.experimental.proxy_tensor import make_fx

import phi_torch_jit as ptj
from phi_torch_jit._compat import _vec_isa
from phi_torch_jit.engines import _background, _warm_starts
from phi_torch_jit.engines import auto as auto_engine


@pytest.fixture(autouse=True)
def _compiles_settle() -> Iterator[None]:
    yield
    assert _background.wait_idle(SETTLE_S), "a background compile did not finish"


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh inductor cache directory, as on a new machine."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_vec_isa, "_KNOWN", {})
    return tmp_path


class _Backend:
    """Returns the graph itself, counting compiles and calls of what it returned; ``gate``
    (when given) holds the compile until the test sets it."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.compiles = 0
        self.calls = 0
        self.gate = gate
        self.__name__ = "counting"
        self.awaited: list[int] = []
        """How many callers waited for the compile thread during each compile."""

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.compiles += 1
        self.awaited.append(_background._WORKER.awaited)
        if self.gate is not None:
            assert self.gate.wait(60)

        def run(*args: torch.Tensor) -> Any:
            self.calls += 1
            return gm.forward(*args)

        return run


def step(x: torch.Tensor) -> torch.Tensor:
    return torch.cos(x) * 2 + x


@pytest.mark.parametrize("remembered", [True, False], ids=["warm", "cold"])
def test_a_remembered_program_is_loaded_after_the_first_call_and_serves_the_second(
    monkeypatch: pytest.MonkeyPatch, remembered: bool
) -> None:
    monkeypatch.setattr(auto_engine, "remembered", lambda target: remembered)
    monkeypatch.setattr(_warm_starts, "WARM_WAIT_S", 600.0)  # no load may time out here
    backend = _Backend()
    jitted = ptj.jit(step, engine="auto", backend=backend, fallback="off")
    x = torch.randn(7)
    torch.testing.assert_close(jitted(x), step(x))  # the record pass
    program = program_of(jitted)
    assert program.warm_start is remembered
    torch.testing.assert_close(jitted(x), step(x))
    if remembered:  # queued by the first call, awaited by the second, which it served
        assert backend.compiles == 1 and backend.calls == 1
        assert backend.awaited == [1]  # it ran without yielding to the caller, who waited
        assert program.tier == "counting" and program.switched_after_calls == 0
        assert "expected in inductor's caches (a warm start)" in jitted.explain()
    else:  # the fast tier served it; the compile is queued at the next call, as before
        assert backend.compiles == 0 and backend.calls == 0
        assert program.tier == "straight-line"
    jitted(x)  # cold: queues the compile (and is served by it if it ended meanwhile)
    assert jitted.wait_compiled(SETTLE_S)
    torch.testing.assert_close(jitted(x), step(x))
    assert backend.compiles == 1 and backend.calls in ((3,) if remembered else (1, 2))


def test_a_load_slower_than_the_wait_leaves_the_call_to_the_fast_tier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gate opens only after the second call returned: that call cannot have been served
    by the compiled program, whatever the machine's speed; nothing hangs, and the switch comes
    when the load ends."""
    monkeypatch.setattr(auto_engine, "remembered", lambda target: True)
    monkeypatch.setattr(_warm_starts, "WARM_WAIT_S", 0.01)
    gate = threading.Event()
    backend = _Backend(gate)
    jitted = ptj.jit(step, engine="auto", backend=backend, fallback="off")
    x = torch.randn(7)
    jitted(x)
    torch.testing.assert_close(jitted(x), step(x))
    assert backend.calls == 0 and program_of(jitted).tier == "straight-line"
    torch.testing.assert_close(jitted(x), step(x))  # waits no more
    gate.set()
    assert jitted.wait_compiled(SETTLE_S)
    torch.testing.assert_close(jitted(x), step(x))
    assert backend.compiles == 1 and backend.calls == 1


def _target(fn: Any, *inputs: torch.Tensor, backend: str = "inductor", **settings: Any) -> Any:
    graph = make_fx(fn)(*inputs)
    metas = [(t.size(), t.stride(), t.dtype, t.device, t.requires_grad) for t in inputs]
    return SimpleNamespace(graph=graph, backend=backend, settings=settings,
                           grad_enabled=torch.is_grad_enabled(), metas=metas)  # fmt: skip


def test_the_fingerprint_sees_the_graph_its_inputs_the_grad_mode_and_the_settings() -> None:
    x = torch.randn(4, 3)
    key = _warm_starts.fingerprint(_target(step, x))
    assert key is not None and key == _warm_starts.fingerprint(_target(step, x))  # traced again
    others = [
        _target(lambda x: torch.sin(x) * 2 + x, x),
        _target(step, torch.randn(4, 4)),
        _target(step, x.double()),
        _target(step, x.t()),
        _target(step, x.requires_grad_()),
        _target(step, x, max_autotune=True),
    ]
    with torch.no_grad():
        others.append(_target(step, x))
    keys = {_warm_starts.fingerprint(target) for target in others}
    assert key not in keys and len(keys) == len(others)
    assert _warm_starts.fingerprint(_target(step, x, backend="aot_eager")) is None


def test_a_compile_is_remembered_in_the_cache_directory_it_went_to(cache_dir: Path) -> None:
    target = _target(step, torch.randn(5))
    assert not _warm_starts.remembered(target)
    _warm_starts.remember(target)
    assert _warm_starts.remembered(target)
    assert list((cache_dir / "phi_torch_jit" / "compiled").iterdir())
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False):  # inductor keeps nothing: no promise
        assert _warm_starts.fingerprint(target) is None and not _warm_starts.remembered(target)
    _warm_starts.forget_all()
    assert not _warm_starts.remembered(target)


@pytest.mark.slow
def test_a_second_jit_of_the_same_step_is_served_by_inductor_from_its_second_call(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a second process of the same script does: the first jit compiles (cold) and
    remembers; the second finds the program remembered, loads it from inductor's caches after
    its first call, and serves its second call with it."""

    def heat(u: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            u = u + 0.1 * (torch.roll(u, 1) - 2 * u + torch.roll(u, -1))
        return torch.tanh(u)

    monkeypatch.setattr(_warm_starts, "WARM_WAIT_S", 600.0)  # a busy machine loads slowly
    u = torch.randn(64)
    cold = ptj.jit(heat, engine="auto")
    cold(u)
    cold(u)
    assert cold.wait_compiled(SETTLE_S) and program_of(cold).tier == "inductor", cold.explain()
    assert not program_of(cold).warm_start
    warm = ptj.jit(heat, engine="auto")
    torch.testing.assert_close(warm(u), heat(u))
    assert program_of(warm).warm_start, warm.explain()
    torch.testing.assert_close(warm(u), heat(u), rtol=1e-5, atol=1e-6)
    assert program_of(warm).tier == "inductor" and program_of(warm).switched_after_calls == 0


@pytest.mark.slow
def test_a_remembered_program_whose_cache_was_emptied_is_compiled_without_the_header(
    cache_dir: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fingerprint that predicts a load wrongly (inductor's caches emptied, our markers
    kept): the compile expected to load skips the precompiled header (_compat/_warm_load.py),
    so its C++ is built without it; the program is still correct and becomes the tier."""
    import shutil

    import torch._inductor.utils as inductor_utils

    def wave(u: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            u = u + 0.2 * (torch.roll(u, 2) - u).sin()
        return u * u

    monkeypatch.setattr(_warm_starts, "WARM_WAIT_S", 600.0)
    u = torch.randn(48)
    cold = ptj.jit(wave, engine="auto", compile_on="caller")
    cold(u)
    cold(u)
    assert program_of(cold).tier == "inductor", cold.explain()
    emptied = tmp_path_factory.mktemp("emptied")
    shutil.copytree(cache_dir / "phi_torch_jit", emptied / "phi_torch_jit")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(emptied))
    inductor_utils.clear_caches()  # nor in this process's memory: as a new process
    warm = ptj.jit(wave, engine="auto")
    torch.testing.assert_close(warm(u), wave(u))
    assert program_of(warm).warm_start, warm.explain()
    torch.testing.assert_close(warm(u), wave(u), rtol=1e-5, atol=1e-6)
    assert warm.wait_compiled(SETTLE_S) and program_of(warm).tier == "inductor", warm.explain()
    torch.testing.assert_close(warm(u), wave(u), rtol=1e-5, atol=1e-6)
    assert list(emptied.glob("**/*.so")), "the program's C++ was built again"


_RIPPLE = """
import logging, sys, torch, phi_torch_jit as ptj
logging.basicConfig(level=logging.WARNING)
def ripple(u):
    return torch.tanh(u * 1.5 + torch.roll(u, 1)) * u
u = torch.randn(40)
jitted = ptj.jit(ripple, engine="auto", compile_on="caller")
jitted(u); out = jitted(u)
torch.testing.assert_close(out, ripple(u), rtol=1e-5, atol=1e-6)
print("tier", jitted.specializations[0].program.tier)
"""


@pytest.mark.slow
def test_a_library_a_killed_build_left_empty_is_built_again(cache_dir: Path) -> None:
    """A build killed mid-write (Ctrl-C, a killed job) leaves an empty library in inductor's
    cache; inductor builds only what is missing, so every later process failed to load it
    and served the captured graph uncompiled (found when a killed test run broke the next).
    Two processes, as it happens (a process that loaded a library keeps its mapping)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", _RIPPLE], env=env, capture_output=True,
                              text=True, timeout=600)  # fmt: skip

    first = run()
    assert first.returncode == 0 and "tier inductor" in first.stdout, first.stderr
    libraries = list(cache_dir.glob("**/*.so"))
    assert libraries
    for library in libraries:
        library.write_bytes(b"")  # as a killed build leaves it
    second = run()
    assert second.returncode == 0 and "tier inductor" in second.stdout, second.stderr
    rebuilt = re.findall(r"broken library \((\S+\.so), a build cut short\)", second.stderr)
    assert rebuilt, second.stderr
    assert all(Path(path).stat().st_size > 0 for path in rebuilt)  # built again


def test_only_a_library_that_is_not_one_is_deleted(tmp_path: Path) -> None:
    from phi_torch_jit._compat._warm_load import rebuilt_if_broken

    broken, sound = tmp_path / "a.so", tmp_path / "b.so"
    broken.write_bytes(b"")
    sound.write_bytes(b"\x7fELF and the rest")
    calls: list[int] = []

    def failing_on(path: Path) -> Any:
        def compile_now() -> str:
            calls.append(1)
            if len(calls) == 1:
                raise ImportError(f"{path}: file too short")
            return "compiled"

        return compile_now

    assert rebuilt_if_broken(failing_on(broken)) == "compiled" and not broken.exists()
    calls.clear()
    with pytest.raises(ImportError):  # a real library: not ours to delete; the error stands
        rebuilt_if_broken(failing_on(sound))
    assert sound.exists() and calls == [1]


def test_the_vector_instruction_probe_runs_once_per_machine(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probes: list[bool] = []
    monkeypatch.setattr(_vec_isa, "_probe", lambda: probes.append(True) or True)
    expected = {} if not _vec_isa_applies() else {_vec_isa.VEC_ISA_SETTING: True}
    assert _vec_isa.vec_isa_settings() == expected
    if not expected:
        return
    monkeypatch.setattr(_vec_isa, "_KNOWN", {})  # a new process
    assert _vec_isa.vec_isa_settings() == expected and probes == [True]
    (record,) = (cache_dir / "phi_torch_jit").glob("vec_isa-*.json")
    record.write_text('{"all_built": false}')  # a set that failed: inductor probes, as before
    monkeypatch.setattr(_vec_isa, "_KNOWN", {})
    assert _vec_isa.vec_isa_settings() == {} and probes == [True]
    record.write_text("not json")  # unreadable: probed again
    monkeypatch.setattr(_vec_isa, "_KNOWN", {})
    assert _vec_isa.vec_isa_settings() == expected and probes == [True, True]
    import torch._inductor.config as inductor_config

    with inductor_config.patch({_vec_isa.VEC_ISA_SETTING: False}):  # the user's choice stands
        assert _vec_isa.vec_isa_settings() == {}


def test_inductors_further_probes_are_kept_per_machine(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AVX-512's BF16 and VNNI checks (``VecISA.check_build``) were built and loaded in a
    child Python in every process: each answer is kept, keyed by the program and the set."""
    from torch._inductor.cpu_vec_isa import VecAVX2, VecISA

    built: list[str] = []

    def check_build(isa: Any, code: str) -> bool:  # inductor's, as a stand-in
        built.append(code)
        return code != "int fails;"

    monkeypatch.setattr(VecISA, "check_build", check_build)
    _vec_isa._keep_builds()
    isa = VecAVX2()
    assert isa.check_build("int a;") and not isa.check_build("int fails;")
    assert isa.check_build("int a;") and built == ["int a;", "int fails;"]
    monkeypatch.setattr(_vec_isa, "_BUILDS", {})  # a new process: the record answers
    assert isa.check_build("int a;") and not isa.check_build("int fails;")
    assert built == ["int a;", "int fails;"]
    assert isa.check_build("int b;") and built[-1] == "int b;"  # another program: built
    (record,) = (cache_dir / "phi_torch_jit").glob("vec_isa_builds-*.json")
    record.write_text("not json")  # unreadable: built again
    monkeypatch.setattr(_vec_isa, "_BUILDS", {})
    assert isa.check_build("int a;") and built[-1] == "int a;"


def _vec_isa_applies() -> bool:
    import platform
    import sys

    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def test_the_kept_answer_picks_the_sets_inductors_probe_finds(cache_dir: Path) -> None:
    """With the setting the kept answer gives, inductor picks what its own probe found (the
    real probe: about a second, once per process)."""
    import torch._inductor.config as inductor_config

    from phi_torch_jit._compat._private import VEC_ISA_LIST

    settings = _vec_isa.vec_isa_settings()
    if not settings:
        pytest.skip("no kept answer here: inductor probes in every process")
    probed = [str(isa) for isa in VEC_ISA_LIST.find()()]
    with inductor_config.patch(settings):
        assert [str(isa) for isa in VEC_ISA_LIST.find().__wrapped__()] == probed


def test_a_cache_directory_that_cannot_be_made_keeps_nothing_and_raises_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # made first: make_fx imports dynamo, whose import makes the cache directory (run alone,
    # as -n 2 may place it, the test failed there, before anything of ours ran)
    target = _target(step, torch.randn(5))
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(_vec_isa, "_KNOWN", {})
    _warm_starts.remember(target)
    assert not _warm_starts.remembered(target)
    assert _vec_isa.vec_isa_settings() == {}
