import functools
import os
import sys
import sysconfig
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import pytest
import torch
from helpers import SETTLE_S

import phi_torch_jit
from phi_torch_jit import _compat, _meter
from phi_torch_jit.engines import _background, _compile_worker, _looped, register_engine
from phi_torch_jit.engines.auto import AutoEngine

sys.path.insert(0, str(Path(__file__).parent))


DEVICE_ENV = "PHI_TORCH_JIT_TEST_DEVICE"
"""``cuda`` (``make test-cuda``): tensors the tests create without naming a device are made on
CUDA (``torch.set_default_device``), and PhiML's default device follows; default ``cpu``, where
PhiML is pinned to the CPU too (it makes the GPU its default when one exists)."""

TEST_DEVICE = torch.device(os.environ.get(DEVICE_ENV, "cpu"))

if TEST_DEVICE.type == "cuda":
    if not torch.cuda.is_available():
        raise pytest.UsageError(f"{DEVICE_ENV}=cuda, but torch sees no CUDA device")
    torch.set_default_device(TEST_DEVICE)


def _pin_phiml() -> None:
    try:
        with warnings.catch_warnings():  # PhiML's import-time notices, outside any test's filter
            warnings.simplefilter("ignore")
            from phiml.backend import torch as phiml_torch
    except ImportError:
        return
    backend = phiml_torch.TORCH
    kind = "GPU" if TEST_DEVICE.type == "cuda" else "CPU"
    devices = backend.list_devices(kind)
    if devices:
        backend.set_default_device(devices[0])


if torch.cuda.is_available():  # without CUDA PhiML stays on the CPU anyway
    _pin_phiml()


@pytest.fixture
def device() -> torch.device:
    """The device the suite runs on (``PHI_TORCH_JIT_TEST_DEVICE``, default the CPU)."""
    return TEST_DEVICE


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def no_compile_left_running() -> None:
    """Every test starts with no background compile running: one an earlier test left
    running holds the tracing lock, and a new function's calls then run eagerly without a
    record pass, unwarned; its record pass comes a call later. Orders of the suite failed
    that way (2026-11-30: the auto-on-caller cases of ``test_reads_draws``; a captured solve
    that ran PhiML's Python in ``test_solve_graphs``; 2026-12-02, two pytest-xdist processes
    on a loaded machine: 57 tests of ``test_reads*`` after an inductor compile of another
    file). The wait is a net for a compile that hangs (:data:`helpers.SETTLE_S`), not a time
    any test depends on."""
    assert _background.wait_idle(SETTLE_S), "a background compile of an earlier test did not finish"


def _still() -> float:
    return 0.0


@pytest.fixture(autouse=True)
def _clocks_that_stand_still(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test depends on wall-clock time or on which path a measurement picked: the clocks
    that decisions read (a specialization's meter, a signature's paths, the choice between a
    library solve's programs) stand still, so every compiled program measures as fast as eager
    code and serves (the same calls run eagerly on a busy machine as on a quiet one). Tests of
    the decisions themselves put a fake clock in their place (test_meter.py)."""
    monkeypatch.setattr(_meter, "CLOCK", _still)
    monkeypatch.setattr(_looped, "CLOCK", _still)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") and not torch.cuda.is_available():
        pytest.skip("needs CUDA (none here); runs in make test-cuda on a GPU machine")


NO_TORCHSCRIPT_ENV = "PHI_TORCH_JIT_TEST_NO_TORCHSCRIPT"
"""Set to 1 (``make test-no-torchscript``): torch.jit.trace, trace_module and script raise for the
whole session, as in a torch without TorchScript; the suite runs, the shared suite with the
engines that must work without it, and tests marked ``uses_torchscript`` or
``torchscript_bodies`` are skipped."""

NO_TORCHSCRIPT = os.environ.get(NO_TORCHSCRIPT_ENV, "") == "1"

AUTO_ON_CALLER = "auto-on-caller"
"""Engine "auto" with ``compile_on="caller"``: the switch to the compiled tier comes inside
the second call of each specialization, so trace and call counts are deterministic."""

register_engine(AUTO_ON_CALLER, functools.partial(AutoEngine, compile_on="caller"))

DEFAULT_TEST_ENGINE = f"{AUTO_ON_CALLER}:aot_eager"
"""What ``jit(f)`` without an engine runs in tests that do not name one: the default engine
("auto", TorchScript-free), compiling on the caller's thread with a backend that runs the whole
capture without inductor's code generation, so trace counts and the switch to the compiled
tier are deterministic and the suite stays within CI's time. Inductor itself: tests marked
slow; the background thread: test_auto_engine.py. ``PHI_TORCH_JIT_ENGINE`` set outside pytest
wins (the shared suite sets it per engine)."""

os.environ.setdefault("PHI_TORCH_JIT_ENGINE", DEFAULT_TEST_ENGINE)
os.environ.setdefault(_compile_worker.NICE_ENV, "0")
"""The compile worker at the tests' own priority: at +10 beside two busy processes on two
cores, an inductor compile a test waited for took over 300 s (a fresh clone's ``make test``,
2026-12-02). ``test_compile_process`` checks the lowered priority itself."""

_COMPILE_TEST_ENGINE = "compile:aot_eager"
_COMPILING_ENGINES = (_COMPILE_TEST_ENGINE, DEFAULT_TEST_ENGINE)
_ALL_ENGINES = ("torchscript", *_COMPILING_ENGINES)

ENGINES_ENV = "PHI_TORCH_JIT_TEST_ENGINES"
"""Comma-separated names out of ``torchscript``, ``compile:aot_eager`` and
``auto-on-caller:aot_eager``: the shared suite runs with these only. ``make test`` sets it to
the default engine's for the suite on the torch releases other than the demo's, which runs all
three (CI's time: docs/engines.md, torch versions)."""


def _chosen_engines() -> tuple[str, ...]:
    engines = _COMPILING_ENGINES if NO_TORCHSCRIPT else _ALL_ENGINES
    chosen = os.environ.get(ENGINES_ENV, "").strip()
    if not chosen:
        return engines
    names = tuple(name.strip() for name in chosen.split(","))
    unknown = [name for name in names if name not in engines]
    if unknown:
        raise pytest.UsageError(f"{ENGINES_ENV}: {unknown} not among {list(engines)}")
    return names


ENGINES = _chosen_engines()
"""What ``@pytest.mark.all_engines`` tests run with: the default engine; the compile engine
with a backend that exercises the whole graph capture (make_fx, dynamo, AOTAutograd, our fake
and backward ops) without inductor's code generation; and engine "auto" with the same backend,
compiling on the caller's thread (its background thread has tests of its own, in
test_auto_engine.py). Inductor itself: tests marked slow. Without TorchScript: the last two.
:data:`ENGINES_ENV` narrows it."""


def _torchscript_removed(*args: Any, **kwargs: Any) -> NoReturn:
    raise RuntimeError("TorchScript is unavailable (PHI_TORCH_JIT_TEST_NO_TORCHSCRIPT=1)")


if NO_TORCHSCRIPT:
    torch.jit.trace = _torchscript_removed  # type: ignore[assignment]
    torch.jit.script = _torchscript_removed  # type: ignore[assignment]
    torch.jit.trace_module = _torchscript_removed  # type: ignore[assignment]


_TORCHSCRIPT_FUNCTIONS = ("trace", "script", "trace_module")
_TORCHSCRIPT_ENGINES = ("torchscript", "compile")
"""The ENGINES entries that use TorchScript: "torchscript", and "compile", whose custom-function
bodies TorchScript compiles by default (``CompileEngine(torchscript=True)``)."""

_OURS = str(Path(phi_torch_jit.__file__).parent) + os.sep
_TESTS = str(Path(__file__).parent) + os.sep
_LIBRARIES = tuple({sysconfig.get_paths()[key] + os.sep for key in ("purelib", "platlib")})
"""Where installed packages live (PhiML, torch, the corpus's libraries); phi_torch_jit is
installed editable, so its files are not under these."""
_CALL_FAILED = pytest.StashKey[bool]()


class TorchScriptUsed(RuntimeError):
    """A test that does not use TorchScript on purpose reached torch.jit.trace/script."""


def _may_use_torchscript(item: pytest.Item) -> bool:
    """Marked ``uses_torchscript``, or in the shared suite with an engine that uses it."""
    if item.get_closest_marker("uses_torchscript"):
        return True
    callspec = getattr(item, "callspec", None)
    engine = callspec.params.get("jit_engine") if callspec is not None else None
    return engine is not None and str(engine).partition(":")[0] in _TORCHSCRIPT_ENGINES


def _ours(frame: FrameType) -> bool:
    return frame.f_code.co_filename.startswith(_OURS)


def _library_by_itself(caller: FrameType) -> bool:
    """Whether an installed library's own code makes this call: the caller is in an installed
    package and no frame of phi_torch_jit is on the stack."""
    if not caller.f_code.co_filename.startswith(_LIBRARIES):
        return False
    frame: FrameType | None = caller
    while frame is not None:
        if _ours(frame):
            return False
        frame = frame.f_back
    return True


def _call_path(caller: FrameType) -> str:
    """The frames of phi_torch_jit and the tests that led to a call, innermost first."""
    found = []
    frame: FrameType | None = caller
    while frame is not None and len(found) < 8:
        name = frame.f_code.co_filename
        if name.startswith((_OURS, _TESTS)):
            found.append(f"{os.path.relpath(name)}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return " <- ".join(found)


class _TorchScriptGuard:
    """torch.jit.trace/script/trace_module for one test: libraries' own calls go through, every
    other call is refused and remembered (a refusal the library catches fails the test too)."""

    def __init__(self, test: str) -> None:
        self.test = test
        self.refused: list[str] = []

    def stand_in(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            if _library_by_itself(caller):
                return original(*args, **kwargs)
            where = f"{os.path.relpath(caller.f_code.co_filename)}:{caller.f_lineno}"
            self.refused.append(f"torch.jit.{name} from {where} (via {_call_path(caller)})")
            raise TorchScriptUsed(
                f"torch.jit.{name} called from {where} in {self.test}, which does not use "
                "TorchScript: the default engine runs none (tests/conftest.py, "
                "_no_torchscript_unless_asked). A test that uses TorchScript on purpose: mark "
                "it @pytest.mark.uses_torchscript."
            )

        return guarded


@pytest.fixture(autouse=True)
def _no_torchscript_unless_asked(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """torch.jit.trace, script and trace_module raise :class:`TorchScriptUsed` in every test
    that does not use TorchScript on purpose: the default engine, and anything jit(f) does
    without naming an engine, runs none.

    The rule:

    * A test may use TorchScript if it is marked ``uses_torchscript`` (it names engine
      "torchscript", an engine with ``torchscript=True``, or tests TorchScript itself) or is
      parametrized with an engine of :data:`_TORCHSCRIPT_ENGINES`.
    * Elsewhere a call is refused, unless an installed library's own code makes it: the direct
      caller is in site-packages and no phi_torch_jit frame is on the stack. PhiML's eager code
      scripts its ``sparse_coo_tensor`` helper at every call, and its own ``jit_compile``
      traces; gpytorch and PyG script helpers at import. Under our record, trace, compile or a
      compiled call, or PhiML's jit routed to us by ``phiflow.install()``, a phi_torch_jit
      frame is on the stack: refused, whoever calls.
    * A refused call fails the test even where the library caught the error (a probe of
      whether TorchScript works is a use of it).
    """
    if _may_use_torchscript(request.node):
        yield
        return
    guard = _TorchScriptGuard(request.node.nodeid)
    for name in _TORCHSCRIPT_FUNCTIONS:
        monkeypatch.setattr(torch.jit, name, guard.stand_in(name, getattr(torch.jit, name)))
    monkeypatch.setattr(_compat, "_TORCHSCRIPT_PROBED", {})  # a probe here calls the guard
    yield
    if guard.refused and not request.node.stash.get(_CALL_FAILED, False):
        pytest.fail(f"TorchScript used without being asked for: {guard.refused}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.stash[_CALL_FAILED] = report.failed
    return report


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Without TorchScript, tests that use it on purpose are skipped, and so are those of
    TorchScript-compiled custom-function bodies and of PhiML code that scripts by itself."""
    if not NO_TORCHSCRIPT:
        return
    uses = pytest.mark.skip(reason="uses TorchScript on purpose; TorchScript removed")
    bodies = pytest.mark.skip(reason="checks TorchScript-compiled bodies; TorchScript removed")
    for item in items:
        if item.get_closest_marker("uses_torchscript"):
            item.add_marker(uses)
        elif item.get_closest_marker("torchscript_bodies"):
            item.add_marker(bodies)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.definition.get_closest_marker("all_engines"):
        metafunc.fixturenames.append("jit_engine")
        metafunc.parametrize("jit_engine", _engines_for(metafunc.module.__name__), indirect=True)


def _engines_for(module: str) -> tuple[str, ...]:
    """ENGINES, except that the PhiFlow tests (the slowest, 5-10 s each) run engine "compile"
    in place of engine "auto": it captures a PhiFlow step as engine "auto" does (make_fx,
    PhiML's custom gradients included: adapters/phiml/_graph_capture) and compiles it with the
    same backend. The default engine runs PhiFlow, without TorchScript, in
    test_phiflow_programs.py and in the tests of test_phiflow.py that name engine "auto"."""
    if module.endswith("test_phiflow"):
        swapped = (_COMPILE_TEST_ENGINE if e == DEFAULT_TEST_ENGINE else e for e in ENGINES)
        return tuple(dict.fromkeys(swapped))
    return ENGINES


@pytest.fixture
def jit_engine(request: pytest.FixtureRequest) -> str:
    """The engine jitted functions created in this test use by default (PHI_TORCH_JIT_ENGINE,
    set by :func:`_engine_of_the_test` for every test of the shared suite)."""
    return str(request.param)


@pytest.fixture(autouse=True)
def _engine_of_the_test(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Set PHI_TORCH_JIT_ENGINE for a test parametrized by ENGINES, whether or not it asks for
    ``jit_engine`` (a fixture only appended to ``fixturenames`` is parametrized but not run)."""
    callspec = getattr(request.node, "callspec", None)
    engine = callspec.params.get("jit_engine") if callspec is not None else None
    if engine is not None:
        monkeypatch.setenv("PHI_TORCH_JIT_ENGINE", engine)
