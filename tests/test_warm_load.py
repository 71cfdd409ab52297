"""Per-process costs of a warm load kept per machine or skipped (_compat/_warm_load.py):
inductor's hash of torch's sources, and the precompiled header while a compile loads."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from phi_torch_jit._compat import _warm_load
from phi_torch_jit._compat._private import PRECOMPILE_HEADER, TORCH_KEY


@pytest.fixture
def torch_key_restored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A fresh cache directory, and inductor's cached torch key as a new process has it (not
    computed); the real value is put back afterwards."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_warm_load, "_KEPT", {})
    torch_key = TORCH_KEY.find()
    real = torch_key()
    torch_key.clear()
    torch_key.real = real  # what inductor computes here (tests compare with it)
    yield torch_key
    del torch_key.real
    torch_key.clear()
    torch_key.set(real)


def test_torchs_source_hash_is_computed_once_per_machine_then_read(torch_key_restored: Any) -> None:
    torch_key = torch_key_restored
    _warm_load.keep_torch_key()
    (record,) = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).glob("phi_torch_jit/torch_key-*")
    real = torch_key()
    assert record.read_text() == real.hex()
    # a new process whose record says otherwise takes the record (it did not hash)
    torch_key.clear()
    record.write_text(b"kept".hex())
    _warm_load._KEPT.clear()
    _warm_load.keep_torch_key()
    assert torch_key() == b"kept"
    # an unreadable record: hashed again, and rewritten
    torch_key.clear()
    record.write_text("not hex")
    _warm_load._KEPT.clear()
    _warm_load.keep_torch_key()
    assert torch_key() == real and record.read_text() == real.hex()


def test_a_hash_computed_already_in_the_process_stands(torch_key_restored: Any) -> None:
    torch_key = torch_key_restored
    torch_key.set(b"computed here")
    _warm_load.keep_torch_key()  # writes the record from this process's value
    torch_key.clear()
    torch_key.set(b"computed again")
    _warm_load._KEPT.clear()
    _warm_load.keep_torch_key()  # the record cannot replace it: no error
    assert torch_key() == b"computed again"


def test_a_cache_directory_that_cannot_be_made_keeps_no_hash(
    torch_key_restored: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(blocker / "cache"))
    _warm_load.keep_torch_key()  # nothing kept, nothing raised; inductor hashes, as without us
    assert not list(tmp_path.glob("**/torch_key-*"))
    assert torch_key_restored() == torch_key_restored.real  # its own hash, not a record's


def test_the_installation_fingerprint_sees_module_files_not_bytecode(tmp_path: Path) -> None:
    package = tmp_path / "torch"
    (package / "_inductor").mkdir(parents=True)
    (package / "__pycache__").mkdir()
    (package / "__init__.py").write_text("x = 1\n")
    (package / "_inductor" / "script.ld").write_text("SECTIONS\n")
    (package / "notes.txt").write_text("a\n")
    first = _warm_load.installation_fingerprint(str(package))
    (package / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"\0")
    (package / "notes.txt").write_text("b\n")
    assert _warm_load.installation_fingerprint(str(package)) == first
    (package / "__init__.py").write_text("x = 2\n")  # an edit in place: size or time changes
    os.utime(package / "__init__.py", ns=(1, 1))
    second = _warm_load.installation_fingerprint(str(package))
    assert second != first
    (package / "_inductor" / "script.ld").write_text("SECTIONS {}\n")  # inductor's extra files
    assert _warm_load.installation_fingerprint(str(package)) != second


def test_the_header_is_not_precompiled_only_while_a_load_is_expected_on_that_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    original = PRECOMPILE_HEADER.find()
    module = sys.modules[original.__module__]
    with _warm_load.headers_skipped():
        wrapper = getattr(module, original.__name__)
    assert wrapper is not original and wrapper.__wrapped__ is original
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(wrapper, "__wrapped__", lambda *args, **kw: calls.append(args) or "pch")
    assert wrapper("h", "cmd") == "pch" and calls == [("h", "cmd")]
    on_other_thread: list[Any] = []
    with _warm_load.headers_skipped():
        assert wrapper("h", "cmd") is None
        with _warm_load.headers_skipped():  # nested
            assert wrapper("h", "cmd") is None
        assert wrapper("h", "cmd") is None
        thread = threading.Thread(target=lambda: on_other_thread.append(wrapper("h", "cmd")))
        thread.start()
        thread.join()
    assert on_other_thread == ["pch"] and len(calls) == 2
    assert wrapper("h", "cmd") == "pch" and len(calls) == 3
    with _warm_load.headers_skipped():  # wrapped once, whatever the number of uses
        assert getattr(module, original.__name__) is wrapper
