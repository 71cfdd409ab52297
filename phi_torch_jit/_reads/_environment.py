"""Stage 1 (reads): the process's state that code names without a variable of the user's:
the environment (``os.environ``, ``os.getenv``), the command line (``sys.argv``, ``argparse``'s
parsing) and ``abc``'s registrations (what ``isinstance`` answers)."""

from __future__ import annotations

import abc
import os
import sys
import types
from typing import Any

from ._code_walk import names_environment
from ._records import Source, Step

__all__ = ["environment_sources", "ABC_TOKEN"]


def environment_sources(code: types.CodeType, held: bool) -> list[tuple[Any, Source]]:
    """The process environment, where a function's code names it: its whole content (a dict
    of a few dozen byte strings: copied and compared in about a microsecond), so a variable
    exported between calls (``os.environ["SIM_SCALE"] = "3"``) retraces. Shown shortened in
    logs (``<dict object>``), never with its values. Likewise ``sys.argv``, where the code
    names ``argv``. ``held``: the function holds an environment reader under another name."""
    where = f"{code.co_filename}:{code.co_firstlineno}"
    found: list[tuple[Any, Source]] = []
    if names_environment(code, _ARGV):  # sys.argv, changed in place (a list of strings)
        found.append((("argv",), Source("sys.argv", where, vars(sys), "argv")))
    if names_environment(code, _TYPE_TESTS):
        found.append((("abc",), ABC_TOKEN))
    if held or names_environment(code):
        environment = Source("the environment (os.environ)", where, vars(os.environ), "_data")
        found.append((("environment",), environment))
    return found


_ARGV = frozenset(("argv", "parse_args", "parse_known_args", "parse_intermixed_args",
                   "parse_known_intermixed_args"))  # fmt: skip
"""Names through which code reads the command line: ``sys.argv``, ``argparse``'s parsing."""
_TYPE_TESTS = frozenset(("isinstance", "issubclass"))
ABC_TOKEN = Source("abc.get_cache_token()", "abc", holder=abc,
                   path=(Step(True, "get_cache_token", call=True),))  # fmt: skip
"""Changes at every ``ABC.register()``: what an ``isinstance`` test or a single-dispatch
function answers (``numbers.Real.register(Q)``) may change with it (probe 41a)."""
