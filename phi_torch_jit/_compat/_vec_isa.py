"""Inductor's probe of the CPU's vector instruction sets, once per machine instead of once per
process (:func:`vec_isa_settings`).

Before its first CPU compile in a process, inductor builds a small C++ program for each
instruction set the CPU claims (AVX2, AVX-512) and loads each in a child Python, to learn which
ones its compiler can use: 1.0-1.2 s of every process on this machine, most of a warm start's
load of a cached program (bench_warm_start, (b): 2.2 s, 1.0 s without the probe). The answer
only changes with the CPU, the compiler and torch, so it is kept on disk, in inductor's cache
directory, keyed by those. Where every claimed set built and loaded, later compiles run with
inductor's ``cpp.vec_isa_ok`` set, which skips the probe and picks the same sets; where one
failed, nothing is set and inductor probes in every process, as it does without us.

The set inductor picks is then probed further in every process: whether AVX-512's BF16 and
VNNI extensions (or AMX) build, each a small C++ program built once and loaded in a child
Python every time (0.28 s of a 0.73 s warm load, bench-peers (a)). Their answers depend on
the same things and on the program's code: :func:`_keep_builds` keeps each per machine too,
in a second record beside the first (``VecISA.check_build``, a private API).

``cpp.vec_isa_ok`` is one of the settings inductor's cache keys hash: compiles get it from the
first one on (the probe runs before it), so every process of a machine compiles with the same
settings and finds the programs earlier ones cached.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from ._private import INDUCTOR_CACHE_DIR, VEC_ISA, VEC_ISA_LIST

__all__ = ["vec_isa_settings", "VEC_ISA_SETTING"]

VEC_ISA_SETTING = "cpp.vec_isa_ok"

_logger = logging.getLogger("phi_torch_jit")
_KNOWN: dict[str, bool] = {}
"""Record path -> whether every claimed set built, for this process."""
_LOCK = threading.Lock()


def vec_isa_settings() -> dict[str, Any]:
    """Inductor settings for a CPU compile: ``{"cpp.vec_isa_ok": True}`` where this machine's
    record says that every vector instruction set the CPU claims built and loaded (probing
    once, with inductor's own probe, if there is no record yet); ``{}`` elsewhere: on another
    CPU architecture than x86-64 Linux, where the process or the user set ``cpp.vec_isa_ok``
    (``TORCHINDUCTOR_VEC_ISA_OK``), where a set failed, or where the record cannot be kept."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return {}
    import torch._inductor.config as inductor_config

    if inductor_config.cpp.vec_isa_ok is not None:  # decided by the user
        return {}
    try:
        folder = Path(INDUCTOR_CACHE_DIR.find()()) / "phi_torch_jit"
    except OSError:  # no cache directory can be made: inductor probes, as without us
        return {}
    path = folder / f"vec_isa-{_fingerprint()}.json"
    _keep_builds()
    with _LOCK:
        known = _KNOWN.get(str(path))
        if known is None:
            known = _read(path)
        if known is None:
            known = _probe()
            _write(path, known)
        _KNOWN[str(path)] = known
    return {VEC_ISA_SETTING: True} if known else {}


_BUILDS: dict[str, dict[str, bool]] = {}
"""Record path -> (probe key -> whether it built and loaded), for this process."""
_BUILDS_LOCK = threading.Lock()


def _keep_builds() -> None:
    """Make inductor's ``VecISA.check_build(code)`` answer from this machine's record of
    builds (in the cache directory of the moment) where it has one (wrapped once per
    process); a new answer is added to the record."""
    with _BUILDS_LOCK:
        isa_class = VEC_ISA.find()
        check = isa_class.check_build
        if getattr(check, "_phi_torch_jit_kept", False):
            return

        def kept(isa: Any, code: str) -> bool:
            try:
                folder = Path(INDUCTOR_CACHE_DIR.find()()) / "phi_torch_jit"
            except OSError:  # no cache directory: inductor's own check, as without us
                return bool(check(isa, code))
            path = folder / f"vec_isa_builds-{_fingerprint()}.json"
            key = hashlib.sha256(
                repr((type(isa).__qualname__, str(isa), isa.build_arch_flags(), code)).encode()
            ).hexdigest()[:24]
            with _BUILDS_LOCK:
                record = _BUILDS.get(str(path))
                if record is None:
                    record = _BUILDS[str(path)] = _read_builds(path)
                known = record.get(key)
            if known is None:
                known = bool(check(isa, code))
                with _BUILDS_LOCK:
                    record[key] = known
                    _write_record(path, dict(record))
            return known

        kept._phi_torch_jit_kept = True  # type: ignore[attr-defined]
        kept.__wrapped__ = check  # type: ignore[attr-defined]
        isa_class.check_build = kept


def _read_builds(path: Path) -> dict[str, bool]:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(record, dict):
        return {}
    return {k: v for k, v in record.items() if isinstance(k, str) and isinstance(v, bool)}


def _probe() -> bool:
    """Inductor's probe (for this process: its result is cached by inductor), and whether it
    found every set the CPU claims, i.e. the sets it picks with the probe skipped."""
    import torch._inductor.config as inductor_config

    listing = VEC_ISA_LIST.find()
    probed = [str(isa) for isa in listing()]
    with inductor_config.patch({VEC_ISA_SETTING: True}):
        claimed = [str(isa) for isa in listing.__wrapped__()]
    if probed != claimed:
        _logger.info(
            "phi_torch_jit: inductor's compiler builds %s of the vector instruction sets %s "
            "this CPU claims; inductor probes them in every process", probed or "none", claimed,
        )  # fmt: skip
    return bool(probed) and probed == claimed


def _read(path: Path) -> bool | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    built = record.get("all_built") if isinstance(record, dict) else None
    return built if isinstance(built, bool) else None


def _write(path: Path, all_built: bool) -> None:
    _write_record(path, {"all_built": all_built})


def _write_record(path: Path, record: dict[str, Any]) -> None:
    """Write a record atomically (processes may probe at once: the last write wins, and both
    wrote the same answers); a cache directory that cannot be written only costs the probe."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        partial.write_text(json.dumps(record))
        os.replace(partial, path)
    except OSError as error:
        _logger.debug("phi_torch_jit: could not keep the vector instruction probe: %s", error)


_FINGERPRINTS: dict[str, str] = {}


def _fingerprint() -> str:
    """What the probe's answer depends on: torch (version and installation), the CPU's
    feature flags, the C++ compiler inductor would use, and the target architecture setting
    (computed once per process and compiler setting)."""
    import torch._inductor.config as inductor_config

    setting = repr((inductor_config.cpp.cxx, getattr(inductor_config.cpp, "march", None)))
    if setting not in _FINGERPRINTS:
        _FINGERPRINTS[setting] = _computed_fingerprint()
    return _FINGERPRINTS[setting]


def _computed_fingerprint() -> str:
    import torch._inductor.config as inductor_config

    compilers = [c for c in inductor_config.cpp.cxx if c] if isinstance(
        inductor_config.cpp.cxx, (list, tuple)) else [inductor_config.cpp.cxx]  # fmt: skip
    found = []
    for name in compilers:
        where = shutil.which(str(name))
        if where is not None:
            stat = os.stat(where)
            found.append((os.path.realpath(where), stat.st_size, stat.st_mtime_ns))
    parts = (torch.__version__, torch.__file__, _cpu_flags(), compilers, found,
             getattr(inductor_config.cpp, "march", None))  # fmt: skip
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
