"""Stage 5 (serving): never slower than eager (NOTE [never slower than eager]). A fake clock
(``_meter.CLOCK``), call counters and trace counts prove what ran; nothing here is timed."""

from __future__ import annotations

import dataclasses
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

import phi_torch_jit as ptj
from phi_torch_jit import _meter
from phi_torch_jit._signature import flatten_arguments
from phi_torch_jit.engines import CompiledModule, Engine, FunctionTarget, get_engine
from phi_torch_jit.engines.base import CompiledFunction


class FakeClock:
    """Seconds that pass only when the code under test says so."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


FakeClock.__module__ = "builtins"  # not the program's state: a library's class, not walked


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(_meter, "CLOCK", fake)
    return fake


def _meter_for(clock: FakeClock, eager_s: float, record_s: float) -> tuple[_meter.Meter, list]:
    switches: list[str] = []

    def eager(tensors: list[torch.Tensor]) -> str:
        clock.now += eager_s
        return "eager"

    return _meter.Meter(eager, record_s, switches.append), switches


def _compiled(clock: FakeClock, seconds: float) -> Any:
    def run(tensors: list[torch.Tensor]) -> str:
        clock.now += seconds
        return "compiled"

    return run


def test_a_fast_compiled_program_is_kept_after_honest_eager_runs(clock: FakeClock) -> None:
    meter, switches = _meter_for(clock, eager_s=1.0, record_s=40.0)  # a slow first call
    compiled = _compiled(clock, 0.5)
    served = [meter.serve(compiled, []) for _ in range(_meter.WARM_UP + _meter.ROUND)]
    assert served.count("eager") == _meter.SAMPLES and meter.done and not switches
    assert not meter.eager_wins  # done: the specialization calls its program directly now
    assert "serves the compiled program" in meter.describe()


def test_a_program_that_wins_by_far_ends_its_round_after_two_eager_samples(
    clock: FakeClock,
) -> None:
    """A compiled PhiFlow gradient step (13 ms against eager's 480 ms) paid five eager calls
    to learn what two showed: where the program's slowest call is 3x faster than eager's
    fastest, the round ends after EARLY_SAMPLES eager calls."""
    meter, switches = _meter_for(clock, eager_s=1.0, record_s=2.0)
    compiled = _compiled(clock, 0.03)
    calls_to_decide = _meter.WARM_UP + _meter.EARLY_SAMPLES * _meter.EAGER_EVERY
    served = [meter.serve(compiled, []) for _ in range(calls_to_decide)]
    assert meter.done and served.count("eager") == _meter.EARLY_SAMPLES and not switches
    assert "serves the compiled program" in meter.describe()


def test_after_a_switch_a_program_that_wins_by_far_serves_without_new_eager_samples(
    clock: FakeClock,
) -> None:
    """Engine "auto" switches from its fast tier to the compiled one and the measurement
    starts afresh: a PhiFlow step paid two more eager samples (240 ms each, against 9 ms
    compiled) to learn what the samples before the switch showed. The new program is timed
    against those; winning by far, it serves without another eager call."""
    meter, switches = _meter_for(clock, eager_s=1.0, record_s=2.0)
    fast_tier = _compiled(clock, 0.1)
    calls_to_decide = _meter.WARM_UP + _meter.EARLY_SAMPLES * _meter.EAGER_EVERY
    served = [meter.serve(fast_tier, []) for _ in range(calls_to_decide)]
    assert meter.done and served.count("eager") == _meter.EARLY_SAMPLES
    meter.restart()  # the compiled tier takes over
    served = [meter.serve(_compiled(clock, 0.01), []) for _ in range(_meter.EAGER_EVERY + 1)]
    assert meter.done and "eager" not in served and not switches
    assert "measured afresh 1x" in meter.describe() and "eager 1e+03 ms" in meter.describe()


def test_after_a_switch_a_program_not_faster_by_far_is_measured_against_eager_again(
    clock: FakeClock,
) -> None:
    """Eager's samples from before a switch only let a program that wins by far skip the new
    ones: here the new program is 1.05x eager, so eager is sampled again, as in any round;
    its calls timed against the old samples count in that round."""
    meter, switches = _meter_for(clock, eager_s=1.0, record_s=2.0)
    calls_to_decide = _meter.WARM_UP + _meter.EARLY_SAMPLES * _meter.EAGER_EVERY
    for _ in range(calls_to_decide):
        meter.serve(_compiled(clock, 0.1), [])
    meter.restart()
    slower = _compiled(clock, 1.05)
    served = [meter.serve(slower, []) for _ in range(_meter.WARM_UP + _meter.ROUND)]
    assert served.count("eager") == _meter.SAMPLES and meter.done and not switches
    assert "compiled 1.05e+03 ms, eager 1e+03 ms" in meter.describe()


def test_one_slow_call_does_not_hold_back_a_program_that_wins_by_far(clock: FakeClock) -> None:
    """A PhiFlow heat step's program took 2-3 ms beside the background compile, one call
    11.5 ms, eager 29-59 ms: the one slow call (within 3x of eager's fastest) made the round
    run all its eager samples. The program's mean decides: the round ends after two."""
    meter, switches = _meter_for(clock, eager_s=1.0, record_s=2.0)
    times = iter([0.05] * 3 + [0.5] + [0.05] * 100)

    def compiled(tensors: list[torch.Tensor]) -> str:
        clock.now += next(times)
        return "compiled"

    calls_to_decide = _meter.WARM_UP + _meter.EARLY_SAMPLES * _meter.EAGER_EVERY
    served = [meter.serve(compiled, []) for _ in range(calls_to_decide)]
    assert meter.done and served.count("eager") == _meter.EARLY_SAMPLES and not switches


def test_a_program_slow_one_call_in_two_is_measured_the_whole_round(clock: FakeClock) -> None:
    """Fast on most calls but slow on every other one (0.05 and 0.8 against eager's 1.0:
    0.43 on average, not 3x faster): no early decision; the full round keeps the program,
    1.2x faster than eager at its median."""
    meter, switches = _meter_for(clock, eager_s=1.0, record_s=2.0)
    times = iter([0.05, 0.8] * 100)

    def compiled(tensors: list[torch.Tensor]) -> str:
        clock.now += next(times)
        return "compiled"

    served = [meter.serve(compiled, []) for _ in range(_meter.WARM_UP + _meter.ROUND - 1)]
    assert not meter.done and served.count("eager") == _meter.SAMPLES - 1
    meter.serve(compiled, [])
    assert meter.done and not switches


def test_a_compiled_program_faster_than_the_record_pass_but_slower_than_eager_is_dropped(
    clock: FakeClock,
) -> None:
    meter, switches = _meter_for(clock, eager_s=1.0, record_s=40.0)
    compiled = _compiled(clock, 1.8)  # a complex-valued step: 1.8x eager, 0.05x its record
    for _ in range(_meter.TO_DROP):
        meter.serve(compiled, [])
    assert meter.eager_wins and len(switches) == 1


def test_a_slow_compiled_program_is_dropped_after_honest_eager_runs(clock: FakeClock) -> None:
    meter, switches = _meter_for(clock, eager_s=1.0, record_s=1.5)
    compiled = _compiled(clock, 3.0)
    served = [meter.serve(compiled, []) for _ in range(_meter.WARM_UP + _meter.ROUND)]
    assert served.count("eager") == _meter.SAMPLES and not meter.eager_wins and not meter.done
    assert meter.confirming  # found slower once: measured again before it is dropped
    second = [meter.serve(compiled, []) for _ in range(_meter.ROUND)]
    interleaved = ["compiled"] * (_meter.EAGER_EVERY - 1) + ["eager"]
    assert second == interleaved * _meter.SAMPLES  # one eager call in EAGER_EVERY
    assert meter.eager_wins and not meter.done
    assert meter.serve(compiled, []) == "eager"  # from now on
    (switch,) = switches  # one log line, with the figures
    assert "compiled 3e+03 ms" in switch and "eager 1e+03 ms" in switch
    assert "first round compiled 3e+03 ms" in switch and "serves eager code" in switch


def test_a_program_slowed_by_a_burst_of_load_while_measured_is_kept(clock: FakeClock) -> None:
    """The first compiled samples fell in a burst of load (10x slower); interleaved with the
    eager samples, most compiled ones did not, and the program, 2x faster, is kept."""
    meter, switches = _meter_for(clock, eager_s=1.0, record_s=1.5)
    load = iter([10.0] * (_meter.WARM_UP + _meter.SAMPLES))

    def compiled(tensors: list[torch.Tensor]) -> str:
        clock.now += 0.5 * next(load, 1.0)
        return "compiled"

    served = [meter.serve(compiled, []) for _ in range(_meter.WARM_UP + _meter.ROUND)]
    assert meter.done and not meter.eager_wins and not switches
    assert served.count("eager") == _meter.SAMPLES  # interleaved: one round was enough
    assert "first round" not in meter.describe()


def test_a_compiled_program_slower_than_the_record_pass_but_not_than_eager_is_kept(
    clock: FakeClock,
) -> None:
    meter, switches = _meter_for(clock, eager_s=2.0, record_s=1.0)  # record looked fast
    served = [meter.serve(_compiled(clock, 2.1), []) for _ in range(1 + _meter.ROUND)]
    assert meter.done and not meter.eager_wins and not switches
    assert served.count("eager") == _meter.SAMPLES


class SlowEngine(Engine):
    """TorchScript's programs, each call taking 10 fake seconds."""

    name = "slow"

    def __init__(self, clock: FakeClock) -> None:
        self.inner = get_engine("torchscript")
        self.clock = clock

    def compile_function(self, target: FunctionTarget) -> CompiledFunction:
        return self.inner.compile_function(target)

    def compile_module(
        self, module: nn.Module, example_inputs: tuple[torch.Tensor, ...], label: str
    ) -> CompiledModule:
        compiled = self.inner.compile_module(module, example_inputs, label)
        inner, clock = compiled.run, self.clock

        def run(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
            clock.now += 10.0
            return inner(*tensors)

        return dataclasses.replace(compiled, run=run)


@pytest.mark.uses_torchscript  # SlowEngine runs engine "torchscript"'s programs
def test_end_to_end_a_slow_specialization_serves_eager_code_and_says_so(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        clock.now += 1.0  # eager code: one fake second
        return x * 2

    jitted = ptj.jit(step, engine=SlowEngine(clock))
    with caplog.at_level("WARNING", logger="phi_torch_jit"):
        for _ in range(_meter.TO_DROP + 3):
            assert torch.equal(jitted(torch.ones(2)), torch.full((2,), 2.0))
    (specialization,) = jitted.specializations
    assert specialization.meter is not None and specialization.meter.eager_wins
    assert "serves eager code" in jitted.explain()
    assert sum("serves eager code" in r.getMessage() for r in caplog.records) == 1
    kept = ptj.jit(step, engine=SlowEngine(clock), fallback="off")
    for _ in range(_meter.WARM_UP + _meter.ROUND + 3):
        kept(torch.ones(2))
    assert kept.specializations[0].meter is None  # forced: always the compiled program


class TieredEngine(SlowEngine):
    """TorchScript's programs, free until :meth:`switch` puts a slow one in their place, as
    engine "auto" puts its compiled tier in place of the fast one."""

    name = "tiered"

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.slow = False
        self.listeners: list[Any] = []

    def compile_module(
        self, module: nn.Module, example_inputs: tuple[torch.Tensor, ...], label: str
    ) -> CompiledModule:
        compiled = self.inner.compile_module(module, example_inputs, label)
        inner = compiled.run

        def run(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
            self.clock.now += 10.0 * self.slow
            return inner(*tensors)

        return dataclasses.replace(compiled, run=run, on_new_program=self.listeners.append)

    def switch(self) -> None:
        self.slow = True
        for listener in self.listeners:
            listener()


@pytest.mark.uses_torchscript  # SlowEngine runs engine "torchscript"'s programs
def test_a_specialization_is_measured_afresh_when_another_program_takes_over(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        clock.now += 1.0
        return x * 2

    engine = TieredEngine(clock)
    jitted = ptj.jit(step, engine=engine)
    calls = _meter.WARM_UP + _meter.ROUND + 2
    for _ in range(calls):
        jitted(torch.ones(2))
    (specialization,) = jitted.specializations
    meter = specialization.meter
    assert meter is not None and meter.done  # the fast program won
    engine.switch()  # a slower one serves from now on: measured again, then dropped
    with caplog.at_level("WARNING", logger="phi_torch_jit"):
        for _ in range(_meter.TO_DROP + 2):
            assert torch.equal(jitted(torch.ones(2)), torch.full((2,), 2.0))
    assert meter.eager_wins and meter.restarts == 1
    assert "measured afresh 1x" in jitted.explain()
    assert sum("serves eager code" in r.getMessage() for r in caplog.records) == 1


def test_a_fast_specialization_is_kept_and_the_decision_is_per_specialization(
    clock: FakeClock,
) -> None:
    jitted = ptj.jit(lambda x: x * 2)  # compiled calls advance no fake time: fast
    for n in (2, 3):  # engine "auto"'s switch to its compiled tier restarts the measurement
        for _ in range(2 * (_meter.WARM_UP + _meter.ROUND) + 2):
            jitted(torch.ones(n))
    assert all(s.meter is not None and s.meter.done for s in jitted.specializations)
    assert len(jitted.specializations) == 2


def test_a_function_that_retraces_on_every_call_ends_up_eager_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def step(x: torch.Tensor, n: int) -> torch.Tensor:  # a new static value on every call
        return torch.sin(x) * n

    jitted = ptj.jit(step, max_traces=64)
    with caplog.at_level("WARNING", logger="phi_torch_jit"), pytest.warns(ptj.JitWarning) as caught:
        for n in range(_meter.WINDOW + 6):
            torch.testing.assert_close(jitted(torch.ones(1), n), step(torch.ones(1), n))
    assert [str(w.message) for w in caught if "compiling costs more" in str(w.message)]
    assert len(caught) == 1 and caught[0].filename == __file__  # one, at the user's call
    assert jitted.num_traces == _meter.MISSES  # then no more compiles
    assert sum("compiling costs more than it saves" in r.getMessage() for r in caplog.records) == 1
    assert "runs eagerly" in jitted.explain()
    with mock.patch.object(torch, "sin", wraps=torch.sin) as sin:
        jitted(torch.ones(1), 0)  # even a signature compiled before: the Python runs
    assert sin.call_count == 1
    jitted.clear_cache()  # the decision survives, as documented
    jitted(torch.ones(1), 1)
    assert jitted.num_traces == _meter.MISSES


def test_a_training_loop_with_a_few_shapes_keeps_compiling() -> None:
    jitted = ptj.jit(lambda x: x.sin())
    for _ in range(4):
        for n in range(1, 9):  # 8 batch shapes, each reused
            jitted(torch.ones(n))
    assert jitted.num_traces == 8 and "runs eagerly" not in jitted.explain()


def test_fallback_is_validated() -> None:
    with pytest.raises(ptj.ConfigurationError, match="fallback must be one of"):
        ptj.jit(lambda x: x, fallback="sometimes")


def _three_paths(x: torch.Tensor) -> torch.Tensor:  # an exit that varies among a few counts
    for _ in range(3):
        if bool(x.sum() < 1):
            break
        x = x / 2
    return x


class _Paths:
    """``_three_paths`` on a fake clock: eager code takes ``eager_s``, each program run
    (also one whose value guards then fail) ``program_s``; ``programs`` counts the runs."""

    def __init__(
        self, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, eager_s: float, program_s: float
    ) -> None:
        from phi_torch_jit._specialization import Specialization

        self.clock, self.eager_s, self.program_s = clock, eager_s, program_s
        self.programs = 0
        self.inputs = [torch.full((2,), v) for v in (0.1, 0.9, 1.5, 3.0)]  # 0-3 halvings
        run_compiled = Specialization._run_compiled

        def timed(specialization: Specialization, tensors: list[torch.Tensor]) -> Any:
            self.programs += 1
            clock.now += self.program_s
            return run_compiled(specialization, tensors)

        monkeypatch.setattr(Specialization, "_run_compiled", timed)

        def step(x: torch.Tensor) -> torch.Tensor:  # reads none of this object's counters
            clock.now += eager_s  # the Python function: eager code (and record, trace)
            return _three_paths(x)

        self.step = step

    def calls(self, jitted: Any, n: int, start: int = 0) -> None:
        for k in range(start, start + n):
            x = self.inputs[k % len(self.inputs)]
            torch.testing.assert_close(jitted(x), _three_paths(x))


def _paths_said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        m.getMessage() for m in caplog.records if "a signature with several paths" in m.getMessage()
    ]


def _settled(paths: _Paths, caplog: pytest.LogCaptureFixture) -> tuple[Any, int]:
    """``paths.step`` jitted and called past its measurement, then 8 calls more: the jitted
    function, and how many programs those 8 calls ran."""
    jitted = ptj.jit(paths.step)
    with caplog.at_level("WARNING", logger="phi_torch_jit"):
        paths.calls(jitted, 4 * _meter.TO_DROP)
        before = paths.programs
        paths.calls(jitted, 8)
    return jitted, paths.programs - before


def test_paths_whose_vain_runs_cost_more_than_eager_serve_eager_code_and_say_so(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Its paths repeat, so it never misses; but most calls run one to three programs whose
    value guards fail before one holds (until_converged ran at 2-6x eager's time). Each
    program alone is 2x faster than eager; with the vain runs, a call is not: measured so,
    the signature's calls run the Python function, said once, shown by ``explain()``."""
    paths = _Paths(clock, monkeypatch, eager_s=1.0, program_s=0.5)
    jitted, programs = _settled(paths, caplog)
    assert programs == 0  # the last calls ran no program: eager code served them
    assert jitted.num_traces == len(paths.inputs)  # each path compiled once, never again
    (said,) = _paths_said(caplog)
    assert "serves eager code" in said and "programs of its paths, tried in turn" in said
    assert "several paths of" in jitted.explain() and "serves eager code" in jitted.explain()
    assert not any(s.meter is not None and s.meter.eager_wins for s in jitted.specializations)


def test_paths_fast_enough_to_pay_for_their_vain_runs_keep_their_programs(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every call after the first few runs programs in vain, and still the programs (10x
    faster than eager) win: measured, not counted, the signature keeps them."""
    paths = _Paths(clock, monkeypatch, eager_s=1.0, program_s=0.1)
    jitted, programs = _settled(paths, caplog)
    assert programs >= 8 + 3 * 2  # one to four programs a call
    assert not _paths_said(caplog) and "serves eager code" not in jitted.explain()
    assert "serves the programs of its paths, tried in turn" in jitted.explain()


def test_paths_dropped_under_a_burst_of_load_serve_their_programs_again_after_a_revisit(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The programs were measured while a burst of load slowed them (5x); the decision for
    eager code is measured again after ``REVISIT`` eager calls, and the programs serve."""
    paths = _Paths(clock, monkeypatch, eager_s=1.0, program_s=2.5)
    jitted = ptj.jit(paths.step)
    calls = 4 * _meter.TO_DROP
    with caplog.at_level("WARNING", logger="phi_torch_jit"):
        paths.calls(jitted, calls)
        assert "serves eager code" in _paths_said(caplog)[-1]
        paths.program_s = 0.1  # the load is gone
        paths.calls(jitted, _meter.REVISIT + _meter.ROUND + 2, start=calls)
    last = _paths_said(caplog)[-1]
    assert "revisited" in last and last.endswith("serves the programs of its paths, tried in turn")
    before = paths.programs
    paths.calls(jitted, 4)
    assert paths.programs > before


def test_a_new_path_measures_the_paths_afresh(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two paths measured fast; a third (more programs to run in vain) starts the
    measurement over."""
    paths = _Paths(clock, monkeypatch, eager_s=1.0, program_s=0.1)
    jitted = ptj.jit(paths.step)
    every, two = paths.inputs, paths.inputs[:2]
    paths.inputs = two
    paths.calls(jitted, 2 * _meter.TO_DROP)
    assert "serves the programs" in jitted.explain() and jitted.num_traces == 2
    paths.inputs = every[:3]
    paths.calls(jitted, 4)  # the third traces the new path; the fourth is measured afresh
    assert jitted.num_traces == 3 and "measured afresh 1x: a new path" in jitted.explain()


@pytest.mark.parametrize("measured", [False, True])
def test_fallback_off_keeps_every_paths_program(
    measured: bool, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = _Paths(clock, monkeypatch, eager_s=1.0, program_s=0.5)
    jitted = ptj.jit(paths.step, fallback="measure" if measured else "off")
    paths.calls(jitted, 4 * _meter.TO_DROP)
    before = paths.programs
    paths.calls(jitted, 8)
    assert (paths.programs > before) is not measured
    assert ("several paths of" in jitted.explain()) is measured


def test_a_compile_inside_one_timed_call_does_not_make_the_paths_mean() -> None:
    samples = [1.0, 2.0] * 9 + [0.5, 400.0]  # one call compiled a path: 400
    assert _meter.trimmed_mean(samples) == pytest.approx(1.5)
    assert _meter.trimmed_mean([3.0]) == 3.0


def test_a_path_that_holds_first_is_never_measured() -> None:
    jitted = ptj.jit(_three_paths)
    for _ in range(3 * _meter.WINDOW):
        jitted(torch.full((2,), 0.1))
    assert jitted.num_traces == 1 and "runs eagerly" not in jitted.explain()
    assert "several paths" not in jitted.explain()


def _random_depth(x: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    for _ in range(int(depth)):  # a path per value: NOTE [values that never repeat]
        x = torch.tanh(x)
    return x


@pytest.mark.parametrize("fallback", ["measure", "off"])
def test_a_function_whose_specializations_all_run_eagerly_skips_the_lookup(
    fallback: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A depth that never repeats makes its signature's specialization eager; once it served
    ``WINDOW`` calls in a row the calls run the Python function without flattening the
    arguments (the lookup cost 2-4% of such a step, pushing it past 1.1x eager)."""
    jitted = ptj.jit(_random_depth, fallback=fallback)
    x = torch.linspace(-1, 1, 5)
    calls = 0

    def call() -> None:
        nonlocal calls
        depth = torch.tensor(calls % 7 + 1)
        calls += 1
        torch.testing.assert_close(jitted(x, depth), _random_depth(x, depth))

    with caplog.at_level("WARNING", logger="phi_torch_jit"), pytest.warns(ptj.JitWarning):
        while not any(s.eager is not None for s in jitted.specializations):
            call()
            assert calls < 20
        for _ in range(_meter.WINDOW + 2):
            call()
    with mock.patch("phi_torch_jit._jit.flatten_arguments", wraps=flatten_arguments) as flatten:
        call()
    skipped = "skip the signature lookup"
    if fallback == "off":  # the user asked to keep compiling: no such specialization either
        assert flatten.call_count == 1 and skipped not in jitted.explain()
        return
    assert flatten.call_count == 0
    assert skipped in jitted.explain()
    assert sum(skipped in r.getMessage() for r in caplog.records) == 1


def test_a_function_with_one_compiled_specialization_keeps_the_lookup() -> None:
    jitted = ptj.jit(_random_depth)
    x = torch.linspace(-1, 1, 5)
    jitted(x[:2], torch.tensor(3))  # a compiled program for another shape, kept
    with pytest.warns(ptj.JitWarning, match="changed the path"):
        for k in range(2 * _meter.WINDOW):
            jitted(x, torch.tensor(k % 7 + 1))
    assert any(s.eager is not None for s in jitted.specializations)
    assert "skip the signature lookup" not in jitted.explain()
    with mock.patch("phi_torch_jit._jit.flatten_arguments", wraps=flatten_arguments) as flatten:
        jitted(x[:2], torch.tensor(3))
    assert flatten.call_count == 1


def test_a_program_dropped_under_a_burst_of_load_is_served_again_after_a_revisit(
    clock: FakeClock,
) -> None:
    """Both rounds fell in a burst of load that slowed the compiled calls only (a compile of
    another process beside them); the decision for eager code is measured again after
    ``REVISIT`` eager calls, when the load is gone, and the program (2x faster) serves."""
    meter, switches = _meter_for(clock, eager_s=1.0, record_s=1.5)
    loaded = [True]

    def compiled(tensors: list[torch.Tensor]) -> str:
        clock.now += 0.5 * (10.0 if loaded[0] else 1.0)
        return "compiled"

    for _ in range(_meter.TO_DROP):
        meter.serve(compiled, [])
    assert meter.eager_wins and len(switches) == 1
    loaded[0] = False
    served = [meter.serve(compiled, []) for _ in range(_meter.REVISIT - 1)]
    assert served == ["eager"] * (_meter.REVISIT - 1)  # no sample between revisits
    served = [meter.serve(compiled, []) for _ in range(_meter.ROUND)]
    assert served.count("eager") == _meter.SAMPLES  # one round, interleaved
    assert meter.done and not meter.eager_wins and meter.revisits == 1
    assert len(switches) == 2 and "(revisited 1x)" in switches[1]
    assert switches[1].endswith("serves the compiled program")


def test_a_truly_slower_program_is_revisited_less_and_less_often(clock: FakeClock) -> None:
    meter, switches = _meter_for(clock, eager_s=1.0, record_s=1.5)
    compiled = _compiled(clock, 3.0)
    for _ in range(_meter.TO_DROP):
        meter.serve(compiled, [])
    assert meter.eager_wins
    served = [meter.serve(compiled, []) for _ in range(20 * _meter.MAX_REVISIT)]
    revisited = served.count("compiled")
    assert meter.eager_wins and len(switches) == 1  # said once, when first dropped
    assert meter.revisit_after == _meter.MAX_REVISIT
    assert revisited == (_meter.ROUND - _meter.SAMPLES) * meter.revisits
    assert revisited <= 0.01 * len(served)  # 20 slow calls in 4096 once settled
    assert "next after 4096 eager calls" in meter.describe()


def test_while_it_measures_the_program_serves_four_calls_in_five(clock: FakeClock) -> None:
    """From the second call on (the first is the record pass) the program serves at least 8
    of every 10 calls while the meter decides: one timed eager call in ``EAGER_EVERY``."""
    meter, _ = _meter_for(clock, eager_s=1.0, record_s=1.5)
    served = [meter.serve(_compiled(clock, 0.5), []) for _ in range(_meter.WARM_UP + _meter.ROUND)]
    assert meter.done
    for start in range(0, len(served) - 10):
        assert served[start : start + 10].count("compiled") >= 8


def test_a_burst_of_load_slows_samples_of_both_paths(clock: FakeClock) -> None:
    """A burst (a compile beside the caller, ours or another process's) lasting a few calls:
    interleaved, it falls on eager and compiled samples alike and decides nothing alone."""
    burst = set(range(3, 12))  # timed calls 3..11 run 7x slower
    calls = [0]

    def slowed(seconds: float) -> float:
        calls[0] += 1
        return seconds * (7.0 if calls[0] in burst else 1.0)

    def eager(tensors: list[torch.Tensor]) -> str:
        clock.now += slowed(1.0)
        return "eager"

    def compiled(tensors: list[torch.Tensor]) -> str:
        clock.now += slowed(0.5)
        return "compiled"

    switches: list[str] = []
    meter = _meter.Meter(eager, 1.5, switches.append)
    for _ in range(_meter.WARM_UP + _meter.ROUND):
        meter.serve(compiled, [])
    assert meter.done and not meter.confirming and not switches


def test_a_program_whose_backend_failed_is_never_called_compiled() -> None:
    def failing(gm: Any, example_inputs: Any) -> Any:
        raise RuntimeError("sparse tensors are not supported")

    jitted = ptj.jit(lambda x: x * 2 + 1, engine="compile", backend=failing)
    for _ in range(_meter.WARM_UP + _meter.ROUND + 1):
        torch.testing.assert_close(jitted(torch.ones(3)), torch.full((3,), 3.0))
    text = jitted.explain()
    assert "failed (RuntimeError: sparse tensors" in text and "uncompiled graph" in text
    assert "compiled program" not in text and " compiled " not in text.split("step time")[1]


class _Slow(torch.autograd.Function):
    """Identity whose backward takes ``seconds`` on the fake clock."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, clock: Any, seconds: float) -> torch.Tensor:
        ctx.clock, ctx.seconds = clock, seconds
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.clock.now += ctx.seconds
        return g, None, None


def test_the_backward_of_each_path_counts_in_its_step_time(clock: FakeClock) -> None:
    """A program fast forward but slow backward (1 + 10 against eager's 2 + 1) is dropped: the
    meter times what a training step pays, the backward that follows included."""
    w = torch.ones(3, requires_grad=True)

    def path(forward_s: float, backward_s: float) -> Any:
        def run(tensors: list[torch.Tensor]) -> torch.Tensor:
            clock.now += forward_s
            return _Slow.apply(w * 2, clock, backward_s)  # type: ignore[no-untyped-call,no-any-return]

        return run

    switches: list[str] = []
    meter = _meter.Meter(path(2.0, 1.0), 5.0, switches.append)
    compiled = path(1.0, 10.0)
    for _ in range(_meter.TO_DROP + 2):
        meter.serve(compiled, []).sum().backward()
    assert meter.eager_wins and len(switches) == 1
    assert "compiled 1.1e+04 ms" in switches[0] and "eager 3e+03 ms" in switches[0]


def test_without_a_backward_the_forward_alone_decides(clock: FakeClock) -> None:
    w = torch.ones(3, requires_grad=True)

    def path(forward_s: float) -> Any:
        def run(tensors: list[torch.Tensor]) -> torch.Tensor:
            clock.now += forward_s
            return _Slow.apply(w * 2, clock, 10.0)  # type: ignore[no-untyped-call,no-any-return]

        return run

    meter = _meter.Meter(path(2.0), 5.0, [].append)
    served = 0
    while not meter.done and served < _meter.TO_DROP + 2:
        with torch.no_grad():  # inference: no backward follows
            meter.serve(path(1.0), [])
        served += 1
    assert meter.done and served == _meter.WARM_UP + _meter.ROUND


class _Averaging(nn.Module):
    """A forward that replaces its buffer (``self.avg = ...``), as BatchNorm-like code does;
    its Python costs one second on the fake clock."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.register_buffer("avg", torch.zeros(3))
        self.clock = clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.now += 1.0
        self.avg = 0.9 * self.avg + 0.1 * x
        return x + self.avg


def test_eager_samples_leave_a_replaced_buffer_as_compiled_calls_do(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The meter's eager samples ran forward, which put a new tensor in the module: the
    module guard saw a replaced buffer after each and retraced (43-59 traces during one
    inductor compile, probe round 18). The original buffer object now holds the new value,
    as after a compiled call: one trace, the same values as eager, whoever served."""
    from phi_torch_jit._specialization import Specialization

    run_compiled = Specialization._run_compiled

    def slow(specialization: Specialization, tensors: list[torch.Tensor]) -> Any:
        clock.now += 3.0  # slower than eager: the meter samples, then serves eager code
        return run_compiled(specialization, tensors)

    monkeypatch.setattr(Specialization, "_run_compiled", slow)
    model, reference = _Averaging(clock), _Averaging(FakeClock())
    buffer = model.avg
    jitted = ptj.jit(model)
    for i in range(4 * _meter.TO_DROP):
        x = torch.full((3,), float(i % 5))
        torch.testing.assert_close(jitted(x), reference(x))
    assert jitted.num_traces == 1, jitted.explain()
    assert model.avg is buffer
    torch.testing.assert_close(model.avg, reference.avg)
    assert "serves eager code" in jitted.explain()
