"""Whose code is this: the user's, torch's or ours?

Value guards, the print notice and tracer-warning filtering all need to tell
user code from library code; they ask here.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
import types
from typing import Any

import torch

__all__ = ["TORCH_DIR", "OWN_DIR", "STDLIB_DIRS", "is_python_library_file", "user_location",
           "is_user_file", "user_module", "TYPED_IN"]  # fmt: skip

TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
"""Directory of the torch package (trailing separator)."""
OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
"""Directory of phi_torch_jit (trailing separator)."""


def user_location(depth: int, skip_torch: bool = False) -> str | None:
    """``file:line`` of the frame ``depth`` levels above the caller, or None if that frame is
    torch's or phi_torch_jit's own code (``depth=1``: whoever called the caller).

    ``skip_torch``: look past torch's frames first (a conversion torch makes for the user, such
    as ``Tensor.__array__`` calling ``numpy()``).
    """
    frame: Any = sys._getframe(depth + 1)
    while (
        skip_torch and frame.f_back is not None and frame.f_code.co_filename.startswith(TORCH_DIR)
    ):
        frame = frame.f_back
    filename = frame.f_code.co_filename
    if filename.startswith((TORCH_DIR, OWN_DIR)):
        return None
    return f"{filename}:{frame.f_lineno}"


_STDLIB = os.path.dirname(os.__file__)
STDLIB_DIRS = tuple({_STDLIB + os.sep, os.path.realpath(_STDLIB) + os.sep})
"""Python's own library (as written and resolved): the frames of ``random``, ``uuid``...
Packages installed under it (its ``site-packages``) are not part of it:
:func:`is_python_library_file`."""


def is_python_library_file(filename: str) -> bool:
    """Whether code from ``filename`` is Python's standard library."""
    return filename.startswith(STDLIB_DIRS) and not any(
        os.sep + d + os.sep in filename for d in _PACKAGE_DIR_NAMES
    )


_PACKAGE_DIR_NAMES = ("site-packages", "dist-packages")
"""Folders that only hold installed packages, wherever they are (a virtual environment's, the
user's site, Debian's system Python)."""


def _library_dirs() -> tuple[str, ...]:
    dirs = {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    try:
        dirs.update(site.getsitepackages())
        dirs.add(site.getusersitepackages())
    except AttributeError:  # an embedded or virtualenv-patched ``site`` without them
        pass
    return tuple(os.path.realpath(d) + os.sep for d in dirs if d)


_NOT_USER = (
    *{os.path.realpath(d) + os.sep for d in (TORCH_DIR, OWN_DIR)},
    *_library_dirs(),
)
_USER: dict[str, bool] = {}
_INSTALLED_HERE: dict[str, frozenset[str]] = {}
"""Per folder on ``sys.path``: the top-level names its ``*.dist-info`` records list."""


def is_user_file(filename: str) -> bool:
    """Whether code from ``filename`` is the user's: not torch's, not ours, not the standard
    library's or an installed package's (and not generated: ``<string>``, ``<frozen ...>``);
    code typed in (``<stdin>``: the REPL, ``python -``; IPython's cells) is.

    An installed package is one under the interpreter's package folders, under any folder
    named ``site-packages`` or ``dist-packages``, or one that a distribution's ``RECORD``
    lists in the folder on ``sys.path`` that holds it (``pip install --target DIR`` with
    ``DIR`` on ``PYTHONPATH``): its state is the library's, not the user's, and is not
    walked for guards."""
    known = _USER.get(filename)
    if known is None and filename.startswith(TYPED_IN):
        known = _USER[filename] = True
    if known is None:
        path = _resolved(filename) if not filename.startswith("<") else ""
        known = _USER[filename] = (
            bool(path) and not path.startswith(_NOT_USER) and not _installed(path)
        )
    return known


TYPED_IN = ("<stdin>", "<console>", "<ipython-input-")
"""Names of code typed in at a prompt (the user's: a REPL session is a script)."""

_RESOLVED_DIRS: dict[str, str] = {}


def _resolved(filename: str) -> str:
    """``os.path.realpath(filename)``, resolving each folder once: a first record pass met
    2300 module files (PhiFlow's step, torch's modules), and resolving each path component of
    each took 70 ms. A file that is itself a link is resolved whole."""
    if os.path.islink(filename):
        return os.path.realpath(filename)
    folder, name = os.path.split(filename)
    return os.path.join(_resolved_folder(folder), name)


def _resolved_folder(folder: str) -> str:
    real = _RESOLVED_DIRS.get(folder)
    if real is None:
        real = _RESOLVED_DIRS[folder] = os.path.realpath(folder or os.curdir)
    return real


def _installed(path: str) -> bool:
    """Whether ``path`` lies in a package folder or belongs to a recorded distribution."""
    if any(part in _PACKAGE_DIR_NAMES for part in path.split(os.sep)):
        return True
    for entry in sys.path:
        root = _resolved_folder(entry) + os.sep
        if path.startswith(root):
            top = path[len(root) :].split(os.sep, 1)[0]
            if top.removesuffix(".py") in _recorded_tops(root):
                return True
    return False


def _recorded_tops(root: str) -> frozenset[str]:
    """The top-level module and package names that the ``*.dist-info/RECORD`` files in
    ``root`` list (a user's project folder has none: an editable install records its
    metadata in the environment's site-packages, not beside the code)."""
    known = _INSTALLED_HERE.get(root)
    if known is not None:
        return known
    tops: set[str] = set()
    try:
        infos = [e for e in os.scandir(root) if e.name.endswith(".dist-info") and e.is_dir()]
    except OSError:
        infos = []
    for info in infos:
        try:
            with open(os.path.join(info.path, "RECORD"), encoding="utf-8") as record:
                for line in record:
                    first = line.split(",", 1)[0].split("/", 1)[0]
                    if first and not first.endswith((".dist-info", ".data")) and first != "..":
                        tops.add(first.removesuffix(".py"))
        except OSError:
            continue
    known = _INSTALLED_HERE[root] = frozenset(tops)
    return known


def user_module(module: types.ModuleType) -> bool:
    """Whether a module is the user's: one of the user's files (``import settings``) or made
    at run time (``types.ModuleType("config")``), not under a library's package. Its
    attributes are configuration that the code's attribute paths read (``settings.GRAVITY``);
    libraries' modules are not walked."""
    filename = getattr(module, "__file__", None)
    if isinstance(filename, str):
        return is_user_file(filename)
    name = getattr(module, "__name__", None)
    made_at_run_time = getattr(module, "__spec__", None) is None
    if not made_at_run_time or not isinstance(name, str) or name in sys.builtin_module_names:
        return False
    # A submodule a library's C code makes (torch._C._onnx) or its compatibility alias
    # (typing.io) has no file and no spec either: it is its package's, a library's.
    package = sys.modules.get(name.partition(".")[0])
    return not (isinstance(package, types.ModuleType) and package is not module
                and not user_module(package))  # fmt: skip
