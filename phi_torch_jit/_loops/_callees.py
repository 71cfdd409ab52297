"""Loop capture, step 1b: the Python functions a function calls by name, whose loops may be
captured too (a custom forward that calls ``cg(A, b)``, a solver written once and called from
several custom functions).

Only calls spelled ``name(...)`` are followed, where ``name`` is not a local of the calling
function and holds a plain Python function when the call is planned: a module-level function
(the caller's globals) or a closure variable. Methods, attributes (``solvers.cg``) and
functions of torch itself are not followed. The captured callee runs only while the name still
holds the function it was made from (:class:`Callee`): a module-level function redefined later
is called as it is then, as the original code would.
"""

from __future__ import annotations

import ast
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Callee", "CalledFunction", "called_functions", "MAX_DEPTH"]

MAX_DEPTH = 2
"""Calls followed from a custom function's body: its callees and theirs."""


@dataclass(frozen=True)
class CalledFunction:
    """A function called by name, found in the caller's globals or closure."""

    name: str
    function: types.FunctionType
    lookup: Callable[[], Any]
    """What the name holds now (read at each call)."""


def called_functions(fn: types.FunctionType, tree: ast.FunctionDef) -> list[CalledFunction]:
    """The plain Python functions ``fn`` calls by a name that is not one of its locals, in the
    order of first call; torch's own functions and ``fn`` itself are left out."""
    local_names = set(fn.__code__.co_varnames) | set(fn.__code__.co_cellvars)
    free = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    found: dict[str, CalledFunction] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        name = node.func.id
        if name in found or name in local_names:
            continue
        lookup = _lookup(name, fn.__globals__, free)
        if lookup is None:
            continue
        try:
            value = lookup()
        except ValueError:  # an empty cell: the closure variable is not bound yet
            continue
        if (
            isinstance(value, types.FunctionType)
            and value is not fn
            and not (value.__module__ or "").startswith("torch")
        ):
            found[name] = CalledFunction(name, value, lookup)
    return list(found.values())


def _lookup(
    name: str, globals_: dict[str, Any], free: dict[str, types.CellType]
) -> Callable[[], Any] | None:
    if name in free:
        cell = free[name]
        return lambda: cell.cell_contents
    if name in globals_:
        return lambda: globals_.get(name)
    return None  # a builtin, or a name not bound yet


class Callee:
    """Calls the captured version of a function while the caller's name still holds the
    original, and whatever the name holds otherwise."""

    def __init__(self, called: CalledFunction, captured: Callable[..., Any]) -> None:
        self.called = called
        self.captured = captured

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        now = self.called.lookup()
        if now is not self.called.function:
            return now(*args, **kwargs)
        return self.captured(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<{self.called.name} with its loops captured>"
