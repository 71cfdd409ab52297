import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


ENGINES = ("torchscript", "compile:aot_eager")
"""What ``@pytest.mark.all_engines`` tests run with: the default engine, and the compile engine
with a backend that exercises the whole graph capture (make_fx, dynamo, AOTAutograd, our fake
and backward ops) without inductor's code generation. Inductor itself: tests marked slow."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.definition.get_closest_marker("all_engines"):
        metafunc.fixturenames.append("jit_engine")
        metafunc.parametrize("jit_engine", ENGINES, indirect=True)


@pytest.fixture
def jit_engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The engine jitted functions created in this test use by default (PHI_TORCH_JIT_ENGINE)."""
    monkeypatch.setenv("PHI_TORCH_JIT_ENGINE", request.param)
    return str(request.param)
