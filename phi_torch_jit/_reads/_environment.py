"""Stage 1 (reads): the process's state that code names without a variable of the user's:
the environment (``os.environ``, ``os.getenv``), the working directory, the command line
(``sys.argv``, ``argparse``'s parsing) and ``abc``'s registrations (what ``isinstance``
answers)."""

from __future__ import annotations

import abc
import os
import shutil
import sys
import types
from typing import Any

from ._code_walk import first_items, values_read
from ._records import Source, Step
from ._shown import got_names

__all__ = ["environment_sources", "holds_environment_reader", "names_environment", "ABC_TOKEN"]


_ENVIRONMENT_NAMES = frozenset(("environ", "environb", "getenv", "getenvb", "expandvars",
                                "expanduser", "getuser", "home", "which", "get_exec_path",
                                "get_terminal_size", "getproxies", "gettempdir"))  # fmt: skip
"""Names through which code reads the process environment (``os.environ[...]``,
``os.getenv(...)``, ``from os import environ``, ``os.path.expandvars("$DATA")``,
``expanduser("~")``, ``getpass.getuser()``), or calls a library function that reads it
(``Path.home()``: ``HOME``; ``shutil.which``, ``os.get_exec_path()``: ``PATH``;
``shutil.get_terminal_size()``: ``COLUMNS``; ``urllib.request.getproxies()``; probe 50)."""
_ENVIRONMENT_STRINGS = frozenset(("environ", "environb"))
"""String constants through which code reaches the environment (``getattr(os, "environ")``,
``vars(os)["environ"]``, ``operator.attrgetter("environ")``)."""


def names_environment(code: types.CodeType, names: frozenset[str] = _ENVIRONMENT_NAMES) -> bool:
    """Whether ``code`` or code nested in it (a lambda, a comprehension) names the
    environment (or one of ``names``: ``argv``)."""
    if not names.isdisjoint(code.co_names):
        return True
    strings = _ENVIRONMENT_STRINGS if names is _ENVIRONMENT_NAMES else frozenset()
    return any(
        (isinstance(c, types.CodeType) and names_environment(c, names)) or c in strings
        for c in code.co_consts
        if isinstance(c, (types.CodeType, str))
    )


_ENVIRONMENT_READERS = (os.getenv, os.getenvb, os.path.expandvars, os.path.expanduser,
                        os.get_exec_path, shutil.which, shutil.get_terminal_size)  # fmt: skip
"""Functions that read the process environment, held under any name (``from os import getenv
as env``, ``GETTERS = {"env": os.getenv}``, ``def step(x, get=os.getenv)``)."""


def holds_environment_reader(function: types.FunctionType) -> bool:
    """Whether a global or closure variable ``function`` reads, or one of its defaults, is a
    function that reads the environment (:data:`_ENVIRONMENT_READERS`), or a list, tuple or
    dict holding one."""
    values = values_read(function)
    values += [*(function.__defaults__ or ()), *(function.__kwdefaults__ or {}).values()]
    for value in values:
        items = value.values() if isinstance(value, dict) else value
        held = first_items(items, 64) if isinstance(value, (list, tuple, dict)) else [value]
        if any(any(v is reader for reader in _ENVIRONMENT_READERS) for v in held):
            return True
        if any(_gets_environment(v) for v in held):
            return True
    return False


def _gets_environment(value: Any) -> bool:
    """An ``operator.attrgetter`` of the environment (``GET = attrgetter("environ")``)."""
    return not _ENVIRONMENT_STRINGS.isdisjoint(got_names(value))


def environment_sources(code: types.CodeType, held: bool) -> list[tuple[Any, Source]]:
    """The process environment, where a function's code names it: its whole content (a dict
    of a few dozen byte strings: copied and compared in about a microsecond), so a variable
    exported between calls (``os.environ["SIM_SCALE"] = "3"``) retraces. Logged as
    ``changed``, never with its values. Likewise ``sys.argv``, where the code
    names ``argv``. ``held``: the function holds an environment reader under another name."""
    where = f"{code.co_filename}:{code.co_firstlineno}"
    found: list[tuple[Any, Source]] = []
    if names_environment(code, _ARGV):  # sys.argv, changed in place (a list of strings)
        found.append((("argv",), Source("sys.argv", where, vars(sys), "argv")))
    if names_environment(code, _TYPE_TESTS):  # isinstance: its answers (_type_tests)
        found.append((("abc",), ABC_TOKEN))
    if held or names_environment(code):
        environment = Source("the environment (os.environ)", where, holder=_ENVIRONMENT,
                             path=(Step(True, "read", call=True),), private=True)  # fmt: skip
        found.append((("environment",), environment))
    if names_environment(code, _WORKING_DIRECTORY):
        found.append((("cwd",), _CWD))
    return found


class _Environment:
    """The process environment as a guard reads it: without the variables torch's compile
    stack sets for itself (inductor exports ``TORCHINDUCTOR_CACHE_DIR`` at its first compile
    in a process, which made every step that reads the environment trace, and compile, a
    second time)."""

    def read(self) -> dict[Any, Any]:
        return {k: v for k, v in os.environ._data.items() if k not in _COMPILERS_OWN}  # type: ignore[attr-defined]


_ENVIRONMENT = _Environment()
_COMPILERS_OWN = frozenset(os.environ.encodekey(k) for k in  # type: ignore[attr-defined]
                           ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"))  # fmt: skip


_ARGV = frozenset(("argv", "parse_args", "parse_known_args", "parse_intermixed_args",
                   "parse_known_intermixed_args"))  # fmt: skip
"""Names through which code reads the command line: ``sys.argv``, ``argparse``'s parsing."""
_WORKING_DIRECTORY = frozenset(("getcwd", "getcwdb", "abspath", "realpath", "relpath", "cwd",
                                "absolute", "resolve"))  # fmt: skip
"""Names through which code reads the working directory (``os.getcwd()``,
``os.path.abspath("data")``, ``Path.cwd()``, ``Path("data").resolve()``): an ``os.chdir``
between calls retraces (probe 50)."""
_TYPE_TESTS = frozenset(("issubclass",))
_CWD = Source("the working directory (os.getcwd())", "os", holder=os,
              path=(Step(True, "getcwd", call=True),))  # fmt: skip
ABC_TOKEN = Source("abc.get_cache_token()", "abc", holder=abc,
                   path=(Step(True, "get_cache_token", call=True),))  # fmt: skip
"""Changes at every ``ABC.register()``: what an ``isinstance`` test or a single-dispatch
function answers (``numbers.Real.register(Q)``) may change with it (probe 41a)."""
