"""tools/install_torch.sh: a torch that pip cannot install stops `make` with one clear message.

pip is replaced by a fake interpreter that answers as pip does, so no package is installed.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "install_torch.sh"

CAPPED = """\
ERROR: Cannot install torch==2.15.0 because these package versions have conflicting dependencies.

The conflict is caused by:
    The user requested torch==2.15.0
    The user requested (constraint) torch<=2.14.1

ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/dependency-resolution/
"""
OFFLINE = "ERROR: Could not find a version that satisfies the requirement torch==2.15.0\n"


def _fake_python(tmp_path: Path, answer: str, rc: int) -> Path:
    (tmp_path / "answer.txt").write_text(answer)
    fake = tmp_path / "python"
    fake.write_text(
        f'#!/bin/sh\necho "$@" > {tmp_path}/args\ncat {tmp_path}/answer.txt\nexit {rc}\n'
    )
    fake.chmod(0o755)
    return fake


def _install(python: Path, version: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path)}
    return subprocess.run(
        [str(SCRIPT), str(python), version], cwd=ROOT, env=env, capture_output=True, text=True
    )


def test_a_capped_torch_names_version_reason_and_way_out(tmp_path: Path) -> None:
    done = _install(_fake_python(tmp_path, CAPPED, 1), "2.15.0", tmp_path)
    assert done.returncode == 1
    message = done.stderr
    assert "could not install torch==2.15.0 (requirements/torch-2.15.0.txt)" in message
    assert "The user requested (constraint) torch<=2.14.1" in message
    assert "rm -r /etc/xdg/pip" in message
    assert "make test TORCH_VERSIONS='2.11.0 2.13.0'" in message
    assert "ResolutionImpossible" not in message
    assert (tmp_path / "args").read_text().split()[-2:] == ["-r", "requirements/torch-2.15.0.txt"]


def test_an_unreachable_registry_says_so(tmp_path: Path) -> None:
    done = _install(_fake_python(tmp_path, OFFLINE, 1), "2.15.0", tmp_path)
    assert done.returncode == 1
    assert "Could not find a version" in done.stderr and "registry is reachable" in done.stderr
    assert "rm -r /etc/xdg/pip" not in done.stderr


def test_success_is_quiet_and_an_untested_version_is_refused(tmp_path: Path) -> None:
    done = _install(
        _fake_python(tmp_path, "Successfully installed torch-2.13.0\n", 0), "2.13.0", tmp_path
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    done = _install(_fake_python(tmp_path, "", 0), "2.14.0", tmp_path)
    assert done.returncode == 2 and "not a tested release" in done.stderr
    assert not (tmp_path / "args").read_text().strip().endswith("2.14.0.txt")


@pytest.mark.parametrize("path", sorted((ROOT / "requirements").glob("torch-*.txt")))
def test_each_pin_file_is_what_the_script_reads(path: Path) -> None:
    assert (
        path.read_text().rstrip().splitlines()[-1] == f"torch=={path.stem.removeprefix('torch-')}"
    )
