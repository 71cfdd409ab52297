"""The main demo runs at tiny size, and jit agrees with eager."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "demos"))

import diffusion_cg


@pytest.mark.slow
def test_demo_runs_and_jit_matches_eager(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = diffusion_cg.main(
        ["--size", "12", "--steps", "3", "--iters", "3", "--reps", "2", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert result["max_diff"] < 1e-5
    assert result["rest_finite"] == 1.0
    assert result["loss_last"] < result["loss_first"]
    assert "steps per second: eager" in out
    assert (tmp_path / "diffusion_cg.png").exists()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_smoke_plume_demo_runs_and_jit_matches_eager(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("phi")
    import smoke_plume

    result = smoke_plume.main(
        ["--size", "10", "--steps", "3", "--eager-steps", "2", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert result["max_diff"] < 1e-5
    assert "steps per second: eager" in out
    assert (tmp_path / "smoke_plume.png").exists() and (tmp_path / "smoke_plume.gif").exists()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_rotating_bar_demo_runs_and_jit_matches_eager(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("phi")
    import rotating_bar

    result = rotating_bar.main(
        ["--size", "16", "--steps", "5", "--eager-steps", "4", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert result["max_diff"] < 1e-4  # eager rotates float64 numpy geometry, jit float32
    assert result["traces"] <= 3  # new angles do not recompile
    assert "steps per second: eager" in out
    assert (tmp_path / "rotating_bar.png").exists() and (tmp_path / "rotating_bar.gif").exists()


@pytest.mark.slow
def test_learned_correction_demo_trains_and_agrees_with_eager(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import learned_correction

    result = learned_correction.main(
        ["--size", "8", "--unroll", "2", "--iters", "4", "--batch", "2", "--out", str(tmp_path)]
    )
    assert result["agreement"] < 1e-4  # eager and jit training give the same losses
    assert result["loss_last"] < result["loss_first"]
    assert "iterations per second: eager" in capsys.readouterr().out
    assert (tmp_path / "learned_correction.png").exists()
