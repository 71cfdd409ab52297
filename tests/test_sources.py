"""Whose code is it: a library installed where the interpreter does not look for packages
(``pip install --target DIR`` with ``DIR`` on ``PYTHONPATH``, as on a GPU machine that must not
replace its torch) is a library, not the user's. Its module state is not walked for guards: a
memo cache it fills on the first call is no "Python state the step changes" (PhiFlow's solves
ran eagerly on CUDA for this). Code the user wrote beside it stays the user's and guarded."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import phi_torch_jit as ptj
from phi_torch_jit._sources import is_user_file

_MEMO = '''
import torch
_TABLES = {}

def scaled(x):
    """A library function that builds a table once per shape and keeps it (a memo cache)."""
    key = tuple(x.shape)
    if key not in _TABLES:
        _TABLES.clear()  # keeps one entry, as PhiML's linear functions with forget_traces do
        _TABLES[key] = 2.0
    return x * _TABLES[key]
'''


def _package(folder: Path, name: str, recorded: bool) -> None:
    """``folder/name/__init__.py``, and with ``recorded`` a distribution's ``RECORD`` listing it,
    as ``pip install --target folder`` leaves them."""
    (folder / name).mkdir()
    (folder / name / "__init__.py").write_text(_MEMO)
    if recorded:
        info = folder / f"{name}-1.0.dist-info"
        info.mkdir()
        (info / "RECORD").write_text(
            f"{name}/__init__.py,sha256=x,{len(_MEMO)}\n{name}-1.0.dist-info/RECORD,,\n"
        )


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _import(name: str, monkeypatch: pytest.MonkeyPatch) -> object:
    importlib.invalidate_caches()
    module = importlib.import_module(name)
    monkeypatch.delitem(sys.modules, name)
    return module


def test_a_package_a_record_lists_on_sys_path_is_a_library(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _package(folder, "ptj_target_lib", recorded=True)
    _package(folder, "ptj_target_mine", recorded=False)  # the user's, beside it
    (folder / "ptj_target_script.py").write_text("X = 1\n")
    library = _import("ptj_target_lib", monkeypatch)
    mine = _import("ptj_target_mine", monkeypatch)
    assert not is_user_file(library.__file__)  # type: ignore[attr-defined]
    assert is_user_file(mine.__file__)  # type: ignore[attr-defined]
    assert is_user_file(str(folder / "ptj_target_script.py"))


def test_any_folder_named_site_or_dist_packages_holds_libraries(tmp_path: Path) -> None:
    for name in ("site-packages", "dist-packages"):
        path = tmp_path / "env" / name / "somelib" / "core.py"
        path.parent.mkdir(parents=True)
        path.write_text("")
        assert not is_user_file(str(path))
    assert is_user_file(str(tmp_path / "env" / "my_sim.py"))
    assert not is_user_file("<string>")


@pytest.mark.parametrize("recorded", [True, False], ids=["installed", "users"])
def test_a_librarys_memo_cache_filled_in_the_step_is_not_the_users_state(
    folder: Path, monkeypatch: pytest.MonkeyPatch, recorded: bool
) -> None:
    """Installed: compiled, one trace, no warning, equal to eager; the same file as the user's
    own code: its cache is state the step changes, on the first call only: that call runs as
    its record pass, the next compiles, no warning."""
    name = f"ptj_memo_{'installed' if recorded else 'users'}"
    _package(folder, name, recorded=recorded)
    lib = _import(name, monkeypatch)

    def step(x: torch.Tensor) -> torch.Tensor:
        return lib.scaled(x) + 1  # type: ignore[attr-defined, no-any-return]

    lib._TABLES[(9,)] = 3.0  # type: ignore[attr-defined]  # another shape met earlier, eagerly
    jitted = ptj.jit(step)
    x = torch.arange(3.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ptj.JitWarning)
        for _ in range(3):
            torch.testing.assert_close(jitted(x), x * 2 + 1)
            jitted.wait_compiled()
    warned = [str(w.message) for w in caught if issubclass(w.category, ptj.JitWarning)]
    assert warned == []
    assert "runs eagerly" not in jitted.explain()
    assert jitted.num_traces == 1


def test_files_are_resolved_through_links_with_each_folder_resolved_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As ``os.path.realpath`` would: a user's file reached through a link in a package folder
    is the user's, a library's reached from the user's folder is a library's; a folder is
    resolved once for all its files (a first record pass met 2300 module files)."""
    library = tmp_path / "env" / "site-packages" / "lib"
    mine = tmp_path / "project"
    library.mkdir(parents=True)
    mine.mkdir()
    (mine / "sim.py").write_text("")
    (library / "core.py").write_text("")
    (library / "linked_sim.py").symlink_to(mine / "sim.py")
    (mine / "linked_core.py").symlink_to(library / "core.py")
    (tmp_path / "alias").symlink_to(library, target_is_directory=True)
    assert is_user_file(str(library / "linked_sim.py"))
    assert not is_user_file(str(mine / "linked_core.py"))
    assert not is_user_file(str(tmp_path / "alias" / "core.py"))
    resolved: list[str] = []
    realpath = os.path.realpath

    def counted(path: str) -> str:
        resolved.append(path)
        return realpath(path)

    monkeypatch.setattr(os.path, "realpath", counted)
    many = tmp_path / "many"
    many.mkdir()
    for n in range(20):
        (many / f"m{n}.py").write_text("")
        assert is_user_file(str(many / f"m{n}.py"))
    assert resolved.count(str(many)) == 1
    assert not [path for path in resolved if path.startswith(str(many) + os.sep)]


_SCRIPT = textwrap.dedent(
    """
    import torch, warnings, phi_torch_jit as ptj
    K = 2.0
    def step(x):
        return x * K
    f = ptj.jit(step)
    x = torch.ones(2)
    warnings.simplefilter("error", ptj.JitWarning)
    f(x); f(x)
    K = 3.0
    print(float(f(x)[0]), float(step(x)[0]), f.num_traces)
    """
)


@pytest.mark.parametrize("how", ["stdin", "-c"])
def test_a_step_typed_in_or_given_to_python_c_has_its_globals_guarded(how: str) -> None:
    """Code from ``<stdin>`` (a REPL, ``python -``) and ``python -c``'s ``<string>`` had been
    taken for generated code: its globals were not guarded (found by a probe)."""
    command = [sys.executable, "-"] if how == "stdin" else [sys.executable, "-c", _SCRIPT]
    root = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k != "PHI_TORCH_JIT_ENGINE"}  # the default
    env["PYTHONPATH"] = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(command, input=_SCRIPT if how == "stdin" else None, text=True,
                          capture_output=True, env=env, timeout=600, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3.0", "3.0", "2"]
