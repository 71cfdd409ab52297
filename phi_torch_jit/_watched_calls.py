"""The phases' watches: the functions the record pass wraps to note calls that no compiled
program repeats (random draws, clocks, entropy, files and folders, seeds, grad mode, tensor
hooks, autograd and torch.func transforms inside the step), by owner and name, the wrappers
themselves, which tell whose code calls, and the note they add to this thread's recording
(``_unguardable`` installs the wrappers)."""

from __future__ import annotations

import builtins
import functools
import glob
import io
import os
import pathlib
import random
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import torch

from ._compat import grad_mode_setter
from ._context import Phase, UnguardableNotes, current_frame
from ._sources import OWN_DIR, TORCH_DIR, is_python_library_file, is_user_file

__all__ = ["watched_calls", "noted_once", "note", "note_unguardable", "from_user", "from_anyone",
           "user_line", "recording_notes"]  # fmt: skip


def watched_calls() -> list[tuple[Any, str, str, str]]:
    """(owner, attribute, kind, label) of every function the record pass watches."""
    targets: list[tuple[Any, str, str, str]] = []
    names = [n for n in random.__all__ if callable(getattr(random, n, None))]
    targets += [(random, n, "random", f"random.{n}") for n in names if n[0].islower()]
    methods = [n for n in dir(random.Random) if n[0].islower() and n not in ("getstate",)]
    targets += [(random.Random, n, "random", f"random.Random.{n}") for n in methods]
    targets += [(builtins, "open", "files", "open"), (io, "open", "files", "io.open")]
    targets += [(pathlib.Path, n, "files", f"Path.{n}") for n in _PATH_READS]
    # what a folder lists and a file's metadata, read without opening it (probe 41c)
    targets += [(os, n, "files", f"os.{n}") for n in _OS_READS]
    targets += [(os.path, n, "files", f"os.path.{n}") for n in _OS_PATH_READS]
    targets += [(glob, n, "files", f"glob.{n}") for n in ("glob", "iglob")]
    clocks = ("time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns")
    targets += [(time, n, "random", f"time.{n}") for n in clocks]
    # entropy: uuid4, secrets, SystemRandom (which calls random's own name for it)
    targets += [(os, "urandom", "random", "os.urandom"),
                (random, "_urandom", "random", "os.urandom")]  # fmt: skip
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        legacy = [n for n in dir(numpy.random) if n[0].islower() and n not in _NUMPY_KEEP]
        targets += [(numpy.random, n, "random", f"numpy.random.{n}") for n in legacy
                    if callable(getattr(numpy.random, n))]  # fmt: skip
    for owner in (torch, torch.random):
        targets += [(owner, n, "random", f"torch.{n}") for n in _TORCH_RNG if hasattr(owner, n)]
    targets.append((*grad_mode_setter(), "grad_mode", ""))
    targets.append((torch.Tensor, "register_hook", "tensor_hooks", "Tensor.register_hook"))
    hooks = torch.autograd.graph.saved_tensors_hooks
    targets.append((hooks, "__enter__", "saved_hooks", "saved-tensor hooks"))
    # a new alias made without an op, as .data is: a trace would bake it as a constant
    targets.append((torch.Tensor, "as_subclass", "data", "Tensor.as_subclass"))
    targets.append((torch.Tensor, "set_", "data", "Tensor.set_"))  # swaps storage, as .data =
    for owner in (torch, torch.utils.dlpack):  # a tensor sharing another's memory, made by no op
        targets.append((owner, "from_dlpack", "data", "torch.from_dlpack"))
    # Tensor.backward calls torch.autograd.backward
    targets.append((torch.autograd, "grad", "gradients", "torch.autograd.grad"))
    targets.append((torch.autograd, "backward", "autograd", "torch.autograd.backward"))
    for owner, prefix in ((torch.func, "torch.func"), (torch, "torch")):
        targets += [(owner, n, "functorch", f"{prefix}.{n}") for n in _TRANSFORMS
                    if owner.__dict__.get(n) is not None]  # fmt: skip
    return targets


def from_user(frame: types.FrameType | None) -> bool:
    """Whether the nearest frame outside torch at or above ``frame`` is user code."""
    while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR):
        frame = frame.f_back
    return frame is not None and is_user_file(frame.f_code.co_filename)


def _from_user_via_python(frame: types.FrameType | None) -> bool:
    """Whether the nearest frame outside torch and Python's own library at or above
    ``frame`` is user code: ``secrets.randbelow``, ``uuid.uuid4`` or a ``SystemRandom`` the
    user calls reach ``os.urandom`` through the standard library (a package's ``uuid4``, as
    PhiML names its solves, is the package's own)."""
    while frame is not None and (
        frame.f_code.co_filename.startswith(TORCH_DIR)
        or is_python_library_file(frame.f_code.co_filename)
    ):
        frame = frame.f_back
    return frame is not None and is_user_file(frame.f_code.co_filename)


def _from_code_via_python(frame: types.FrameType | None) -> bool:
    """Whether the nearest frame outside torch and Python's own library at or above
    ``frame`` is anyone's but ours: a library seeding torch's generator in the step (PhiML's
    ``math.seed``) makes every call draw the same numbers, which no compiled program
    repeats; our own rewinding of the generator is not the step's."""
    while frame is not None and (
        frame.f_code.co_filename.startswith(TORCH_DIR)
        or is_python_library_file(frame.f_code.co_filename)
    ):
        frame = frame.f_back
    return frame is not None and not frame.f_code.co_filename.startswith(OWN_DIR)


def user_line(frame: types.FrameType | None) -> str:
    """``file:line`` of the nearest user frame at or above ``frame``."""
    while frame is not None and not is_user_file(frame.f_code.co_filename):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"


def from_anyone(frame: types.FrameType | None) -> bool:
    """Whether code other than torch's and ours is at or above ``frame`` (our frames sit in
    between when a torch-function mode of ours dispatches the call)."""
    while frame is not None and frame.f_code.co_filename.startswith((TORCH_DIR, OWN_DIR)):
        frame = frame.f_back
    return frame is not None


def _not_torchs(frame: types.FrameType | None) -> bool:
    """Whether ``frame`` is not torch's or ours: a ``with`` of the user's or a library's, not
    a non-reentrant checkpoint's (its hooks recompute what they unpack: the same values)."""
    return frame is not None and not frame.f_code.co_filename.startswith((TORCH_DIR, OWN_DIR))


_CHECKING = threading.local()
"""Set while a wrapper decides whether to note a call (its own calls are not noted)."""

_ANYWHERE = frozenset({"autograd", "gradients"})
"""Kinds noted whoever calls (a library's ``autograd.grad`` is as uncapturable as the user's)."""


def _noted(kind: str, label: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``original``, noting calls from user code (any code, for :data:`_ANYWHERE` kinds) in
    this thread's record pass."""
    callers = {"random": _from_user_via_python, "saved_hooks": _not_torchs}
    caller_counts = callers.get(kind, from_user)
    caller_counts = from_anyone if kind in _ANYWHERE else caller_counts
    if kind == "random" and label.rsplit(".", 1)[-1] in _SEEDING:
        caller_counts = _from_code_via_python  # PhiML's math.seed(0) in the step (probe 52)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not getattr(_CHECKING, "on", False):  # telling whose code calls may stat files
            _CHECKING.on = True  # (os.path.islink, watched too): not a call to note
            try:
                caller = sys._getframe(1)
                if caller_counts(caller):
                    where = user_line(caller)
                    note(kind, f"{label} at {where}" if label else where)
            finally:
                _CHECKING.on = False
        return original(*args, **kwargs)

    return wrapper


_WRAPPERS: dict[tuple[int, str, str], tuple[Any, Callable[..., Any]]] = {}
"""The wrapper of each watched function, made once per process and kept: dynamo records the
ids of NumPy's functions when it first meets one (``trace_rules.is_numpy``), and where that was
inside a record pass (``torch.cond`` in the step), it recorded our wrappers of
``numpy.random``'s; freed after the pass, their ids went to the user's lambdas, which dynamo
then took for NumPy functions it cannot trace (an eager ``torch.cond`` raised
UncapturedHigherOrderOpError in the suite, now and then)."""


def noted_once(kind: str, label: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`_noted`, the same wrapper object for the same function every time."""
    key = (id(original), kind, label)
    kept = _WRAPPERS.get(key)
    if kept is None or kept[0] is not original:
        kept = _WRAPPERS[key] = (original, _noted(kind, label, original))
    return kept[1]


def note_unguardable(kind: str, label: str) -> None:
    """Note a call that no compiled program repeats, at the nearest user frame (record pass)."""
    note(kind, f"{label} at {user_line(sys._getframe(1))}")


def recording_notes() -> UnguardableNotes | None:
    """This thread's recording's notes while its record pass runs, else None."""
    frame = current_frame()
    if frame is not None and frame.phase is Phase.RECORD and frame.recording is not None:
        return frame.recording.unguardable
    return None


def note(kind: str, where: str) -> None:
    """Add ``where`` to this thread's recording's unguardable ``kind`` (once; record phase)."""
    if (notes := recording_notes()) is not None:
        seen: list[str] = getattr(notes, kind)
        if where not in seen:
            seen.append(where)


_NUMPY_KEEP = frozenset(("default_rng", "bit_generator", "test"))
_PATH_READS = ("read_text", "read_bytes", "open", "exists", "is_file", "is_dir", "iterdir",
               "glob", "rglob", "stat", "lstat")  # fmt: skip
_OS_READS = ("listdir", "scandir", "stat", "lstat", "walk", "access")
_OS_PATH_READS = ("exists", "lexists", "isfile", "isdir", "islink", "getsize", "getmtime",
                  "getatime", "getctime")  # fmt: skip
_TORCH_RNG = ("manual_seed", "seed", "set_rng_state", "initial_seed", "get_rng_state")
_SEEDING = frozenset(("manual_seed", "seed", "set_rng_state"))
"""Of those, the ones that set the generator: noted whoever calls them, but us."""
_TRANSFORMS = ("vmap", "grad", "grad_and_value", "jacrev", "jacfwd", "hessian", "vjp", "jvp")
