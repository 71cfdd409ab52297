import functools
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch

from phi_torch_jit.engines import register_engine
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


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") and not torch.cuda.is_available():
        pytest.skip("needs CUDA (none here); runs in make test-cuda on a GPU machine")


NO_TORCHSCRIPT_ENV = "PHI_TORCH_JIT_TEST_NO_TORCHSCRIPT"
"""Set to 1 (``make test-no-torchscript``): torch.jit.trace, trace_module and script raise for the
whole session, as in a torch without TorchScript, and the shared suite runs with the engines
that must work without it."""

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

_COMPILING_ENGINES = ("compile:aot_eager", f"{AUTO_ON_CALLER}:aot_eager")
ENGINES = _COMPILING_ENGINES if NO_TORCHSCRIPT else ("torchscript", *_COMPILING_ENGINES)
"""What ``@pytest.mark.all_engines`` tests run with: the default engine; the compile engine
with a backend that exercises the whole graph capture (make_fx, dynamo, AOTAutograd, our fake
and backward ops) without inductor's code generation; and engine "auto" with the same backend,
compiling on the caller's thread (its background thread has tests of its own, in
test_auto_engine.py). Inductor itself: tests marked slow. Without TorchScript: the last two."""


def _torchscript_removed(*args: Any, **kwargs: Any) -> NoReturn:
    raise RuntimeError("TorchScript is unavailable (PHI_TORCH_JIT_TEST_NO_TORCHSCRIPT=1)")


if NO_TORCHSCRIPT:
    torch.jit.trace = _torchscript_removed  # type: ignore[assignment]
    torch.jit.script = _torchscript_removed  # type: ignore[assignment]
    torch.jit.trace_module = _torchscript_removed  # type: ignore[assignment]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Without TorchScript, custom-function bodies run as Python (loops kept): tests of their
    compiled form, and PhiML code that scripts by itself, are skipped."""
    if not NO_TORCHSCRIPT:
        return
    skip = pytest.mark.skip(reason="checks TorchScript-compiled bodies; TorchScript removed")
    for item in items:
        if item.get_closest_marker("torchscript_bodies"):
            item.add_marker(skip)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.definition.get_closest_marker("all_engines"):
        metafunc.fixturenames.append("jit_engine")
        metafunc.parametrize("jit_engine", _engines_for(metafunc.module.__name__), indirect=True)


def _engines_for(module: str) -> tuple[str, ...]:
    """ENGINES, except that the PhiFlow tests (the slowest, 5-10 s each) skip engine "auto":
    PhiML's custom gradients are traced with TorchScript under every engine, and the rest of
    their graphs is the one engine "compile" captures and compiles with the same backend."""
    if module.endswith("test_phiflow"):
        return tuple(e for e in ENGINES if not e.startswith(AUTO_ON_CALLER))
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
