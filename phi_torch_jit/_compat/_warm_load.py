"""Two per-process costs of loading a program from inductor's caches, paid once per machine or
not at all: the hash of torch's sources (:func:`keep_torch_key`) and the preprocessing of the
precompiled header while nothing is built (:func:`headers_skipped`).

**torch's source hash.** Inductor's cache keys include a hash of every module file of the
installed torch (``codecache.torch_key``: it reads about 2,400 files, 0.12-0.17 s of every
process on this machine, most of it on a warm start's first load). The hash only changes when
torch's files do, so it is kept on disk in inductor's cache directory, under a fingerprint of
the installation: the path, size and modification time of every file torch's hash reads
(source and extension modules, and everything under ``_inductor/``; 20-30 ms to collect). A
process with a record sets inductor's cached value (``torch_key.set``, which inductor's own
compile workers use the same way); one without computes it as inductor does and writes the
record. A file of torch edited in place changes its modification time, hence the fingerprint,
hence a new hash is computed: never a stale key.

**The precompiled header.** Before it looks whether a kernel's library is on disk, inductor
preprocesses the C++ header it would precompile and hashes the output (a C++ preprocessor run
and a SHA-512, 0.13-0.16 s per distinct compiler command line and process; two command lines
on a typical CPU program). Where the library exists, nothing is built and the precompiled
header is not used: the library's cache key does not include it. So while a compile is
expected to be a load (:func:`headers_skipped`: a program inductor's caches hold, or one the
compile worker just compiled), the header is not precompiled; a library that turns out to be
missing is then built without it (the same code, a slower build). Other compiles precompile as
inductor does.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from ._private import INDUCTOR_CACHE_DIR, PRECOMPILE_HEADER, TORCH_KEY

__all__ = ["keep_torch_key", "headers_skipped", "rebuilt_if_broken"]

_logger = logging.getLogger("phi_torch_jit")
_LOCK = threading.Lock()
_KEPT: dict[str, bool] = {}
"""Cache directory -> whether this process has set or written torch's hash for it."""
_SKIPPING = threading.local()


def keep_torch_key() -> None:
    """Before a compile: set inductor's hash of torch's sources from this machine's record, or
    compute it and write the record (once per process and cache directory). Any failure
    leaves inductor to compute the hash itself, as without us."""
    try:
        folder = Path(INDUCTOR_CACHE_DIR.find()()) / "phi_torch_jit"
    except OSError:
        return
    with _LOCK:
        if _KEPT.get(str(folder)):
            return
        _KEPT[str(folder)] = True
        torch_key = TORCH_KEY.find()
        path = folder / f"torch_key-{installation_fingerprint()}"
        try:
            kept = bytes.fromhex(path.read_text().strip())
        except (OSError, ValueError):
            kept = None
        if kept:
            try:
                torch_key.set(kept)
            except (AssertionError, RuntimeError):  # computed already in this process
                pass
            return
        value = torch_key()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            partial.write_text(value.hex())
            os.replace(partial, path)
        except OSError as error:  # a read-only cache directory: every process hashes
            _logger.debug("phi_torch_jit: could not keep torch's source hash: %s", error)


_MODULE_SUFFIXES = tuple(
    importlib.machinery.SOURCE_SUFFIXES + importlib.machinery.EXTENSION_SUFFIXES
)


def installation_fingerprint(root: str | None = None) -> str:
    """A hash of torch's version and of the path, size and modification time (ns) of each
    module file under its package directory (and of every file under ``_inductor/``), compiled
    bytecode excluded."""
    root = root or os.path.dirname(torch.__file__)
    inductor = os.path.join(root, "_inductor")
    hasher = hashlib.sha256(f"{torch.__version__}\0{sys.version}\0{root}\n".encode())
    folders = [root]
    while folders:
        folder = folders.pop()
        try:
            with os.scandir(folder) as entries:
                listed = sorted(entries, key=lambda entry: entry.name)
        except OSError:
            continue
        for entry in listed:
            if entry.is_dir(follow_symlinks=False):
                if entry.name != "__pycache__":
                    folders.append(entry.path)
            elif entry.name.endswith(_MODULE_SUFFIXES) or entry.path.startswith(inductor):
                try:
                    stat = entry.stat()
                except OSError:
                    continue
                hasher.update(f"{entry.path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return hasher.hexdigest()[:32]


@contextlib.contextmanager
def headers_skipped() -> Iterator[None]:
    """Within: a compile on this thread expected to load its C++ libraries from inductor's
    caches does not precompile their header (see the module's docstring)."""
    _wrap_precompile_header()
    before = getattr(_SKIPPING, "on", False)
    _SKIPPING.on = True
    try:
        yield
    finally:
        _SKIPPING.on = before


def _wrap_precompile_header() -> None:
    with _LOCK:
        original = PRECOMPILE_HEADER.find()
        module = sys.modules[original.__module__]
        current = getattr(module, original.__name__)
        if getattr(current, "_phi_torch_jit_skips", False):
            return

        def precompile_header(*args: Any, **kwargs: Any) -> Any:
            if getattr(_SKIPPING, "on", False):
                return None  # no precompiled header: a library found on disk is not built
            return precompile_header.__wrapped__(*args, **kwargs)  # type: ignore[attr-defined]

        precompile_header._phi_torch_jit_skips = True  # type: ignore[attr-defined]
        precompile_header.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(module, original.__name__, precompile_header)


_T = TypeVar("_T")
_LIBRARY = re.compile(r"(/[^\s:'\"]+\.so)")


def rebuilt_if_broken(compile_now: Callable[[], _T]) -> _T:
    """``compile_now()``; where it failed loading a library of inductor's cache that is not
    a shared library (an empty or cut-short file: a build killed mid-write, by Ctrl-C or a
    killed job, leaves one, and inductor, which builds only what is missing, then fails on
    it in every later process), that file is deleted and the compile runs once more, which
    builds it again. Other failures propagate."""
    try:
        return compile_now()
    except Exception as error:
        path = _broken_library(error)
        if path is None:
            raise
        _logger.warning(
            "phi_torch_jit: inductor's cache held a broken library (%s, a build cut short); "
            "it is built again", path,
        )  # fmt: skip
        os.unlink(path)
        return compile_now()


def _broken_library(error: BaseException) -> str | None:
    """The path of a library file named by ``error`` (or what caused it) that exists and is
    not an ELF shared object; None otherwise."""
    seen: BaseException | None = error
    for _ in range(6):
        if seen is None:
            return None
        for path in _LIBRARY.findall(str(seen)):
            try:
                with open(path, "rb") as library:
                    magic = library.read(4)
            except OSError:
                continue
            if magic != b"\x7fELF":
                return str(path)
        seen = seen.__cause__ or seen.__context__
    return None
