"""Loop capture, step 1: which loops of a function can be captured, and what each carries.

A loop is a top-level statement of the function: ``while test:``, ``while True:`` or ``for name
in range(...)``, whose body may leave it only through ``if cond: break`` statements at its own
top level. It becomes a list of :class:`Exit` checks and :class:`Segment` statements run in
order each iteration (``while test`` starts with ``Exit(not test)``). What it carries (names it
assigns that a later iteration or the code after the loop reads) and what it only reads
(invariants) are found from the syntax; a loop with anything else (``return``, ``continue``,
``yield``, nested functions, ``global``, ``try``, a name that may be unbound before it) is not
captured, and the reason says which.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Exit", "Segment", "LoopPlan", "FunctionPlan", "plan_function"]


@dataclass(frozen=True)
class Exit:
    """The loop is left when ``test`` is true (``if test: break``)."""

    test: ast.expr


@dataclass(frozen=True)
class Segment:
    """Statements run in order, between exit checks."""

    body: tuple[ast.stmt, ...]


@dataclass(frozen=True)
class LoopPlan:
    """One capturable loop: where it is, what it runs and what it carries."""

    position: int
    """Index of the loop among the function's top-level statements."""
    line: int
    """Its line in the user's file."""
    items: tuple[Exit | Segment, ...]
    """One iteration: exit checks and statements, in order."""
    carried: tuple[str, ...]
    """Names the loop assigns that a later iteration, or the code after it, reads."""
    invariants: tuple[str, ...]
    """Local names it reads and never assigns."""
    preamble: tuple[ast.stmt, ...] = ()
    """Statements that run before it (a ``for`` loop's range, evaluated once)."""
    in_place: frozenset[str] = frozenset()
    """Carried names the loop writes in place (``x += d``, ``x[i] = v``, ``x.add_(d)``) and
    never rebinds: a tensor among them is written back into the object the loop started with,
    as the Python loop leaves it."""
    mixed: frozenset[str] = frozenset()
    """Carried names it both writes in place and rebinds (fine for an int, not for a tensor:
    the Python loop writes the first object until the rebinding)."""


@dataclass(frozen=True)
class FunctionPlan:
    """A function's source, its capturable loops and why the others are not captured."""

    tree: ast.FunctionDef
    loops: tuple[LoopPlan, ...]
    refused: tuple[str, ...]


_FORBIDDEN = (
    ast.Return, ast.Yield, ast.YieldFrom, ast.Await, ast.Global, ast.Nonlocal, ast.Lambda,
    ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Try, ast.Delete, ast.Continue,
)  # fmt: skip


def plan_function(fn: types.FunctionType) -> FunctionPlan | str:
    """The loops of ``fn`` that can be captured, or why none of ``fn`` can be looked at."""
    if hasattr(fn, "__wrapped__"):
        return "it is wrapped by a decorator (its source is not what runs)"
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        module = ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError) as error:
        return f"its source cannot be read ({type(error).__name__})"
    tree = module.body[0] if module.body else None
    if not isinstance(tree, ast.FunctionDef) or tree.name != fn.__code__.co_name:
        return "its source is not a plain def statement"
    ast.increment_lineno(tree, fn.__code__.co_firstlineno - tree.lineno)
    # Closure variables are read through the user's own cells by the rebuilt functions (live,
    # never assigned in the function): not invariants passed in.
    local_names = set(fn.__code__.co_varnames) | set(fn.__code__.co_cellvars)
    loops: list[LoopPlan] = []
    refused: list[str] = []
    assigned = {a.arg for a in (*tree.args.posonlyargs, *tree.args.args, *tree.args.kwonlyargs)}
    for name in (tree.args.vararg, tree.args.kwarg):
        if name is not None:
            assigned.add(name.arg)
    assigned |= set(fn.__code__.co_freevars)
    for position, statement in enumerate(tree.body):
        if isinstance(statement, ast.While | ast.For):
            after = _loads(tree.body[position + 1 :])
            plan = _plan_loop(position, statement, assigned, local_names, after)
            if isinstance(plan, str):
                refused.append(f"line {statement.lineno}: {plan}")
            else:
                loops.append(plan)
        assigned |= _definitely_assigned(statement)
    return FunctionPlan(tree, tuple(loops), tuple(refused))


def _plan_loop(
    position: int,
    loop: ast.While | ast.For,
    assigned: set[str],
    local_names: set[str],
    after: set[str],
) -> LoopPlan | str:
    if loop.orelse:
        return "the loop has an else clause"
    preamble: list[ast.stmt] = []
    if isinstance(loop, ast.For):
        counted = _range_loop(loop, position)
        if isinstance(counted, str):
            return counted
        preamble, head, first, tail = counted
        hidden = {name for statement in preamble for name in _stores(statement)}
        assigned, local_names = assigned | hidden, local_names | hidden
    else:
        head = [] if _is_true(loop.test) else [Exit(_negated(loop.test))]
        first, tail = [], []
    items: list[Exit | Segment] = list(head)
    statements: list[ast.stmt] = []
    for statement in [*first, *loop.body]:
        leave = _break_test(statement)
        if leave is not None:
            if statements:
                items.append(Segment(tuple(statements)))
                statements = []
            items.append(Exit(leave))
            continue
        for node in ast.walk(statement):
            if isinstance(node, _FORBIDDEN):
                return f"its body has {type(node).__name__.lower()} statements or expressions"
            if isinstance(node, ast.Break) and not _inside_inner_loop(statement, node):
                return "it leaves by a break that is not `if cond: break` at its top level"
            effect = _called_for_effect(node)
            if effect:
                return (
                    f"its body calls {effect} for its effect (a Python side effect: a traced "
                    "block would run it once, when traced)"
                )
        statements.append(statement)
    statements.extend(tail)
    if statements:
        items.append(Segment(tuple(statements)))
    if not any(isinstance(i, Exit) for i in items):
        return "it has no exit (while True without break)"
    reads_first, writes = _reads_before_writes(items)
    in_place, rebound = _in_place_and_rebound(items)
    writes |= in_place  # x.mul_(2) changes x as x = x * 2 would: predicated like it
    loads = _loads_of(items)
    carried = sorted(writes & (reads_first | after))
    invariants = sorted((loads - writes) & local_names)
    unbound = [n for n in (*carried, *invariants) if n not in assigned]
    unbound += [n for n in carried if n not in local_names]
    if unbound:
        return f"{unbound[0]!r} may be unbound before the loop"
    if not carried:
        return "it carries no value to the next iteration or past the loop"
    return LoopPlan(
        position, loop.lineno, tuple(items), tuple(carried), tuple(invariants), tuple(preamble),
        frozenset(in_place & set(carried)) - rebound, frozenset(in_place & rebound & set(carried)),
    )  # fmt: skip


def _in_place_and_rebound(items: list[Exit | Segment]) -> tuple[set[str], set[str]]:
    in_place: set[str] = set()
    rebound: set[str] = set()
    for item in items:
        for node in (n for part in _parts(item) for n in ast.walk(part)):
            if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                in_place.add(node.target.id)
            elif isinstance(node, ast.Subscript | ast.Attribute) and isinstance(
                node.ctx, ast.Store
            ):
                base = node.value
                if isinstance(base, ast.Name):
                    in_place.add(base.id)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr.endswith("_")
                and not node.func.attr.startswith("_")
                and isinstance(node.func.value, ast.Name)
            ):
                in_place.add(node.func.value.id)
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.For | ast.With):
                targets = (
                    node.targets
                    if isinstance(node, ast.Assign)
                    else [getattr(node, "target", None)]
                )
                for target in targets:
                    if target is not None:
                        rebound |= _stores(target)
    return in_place, rebound


def _range_loop(
    loop: ast.For, position: int
) -> tuple[list[ast.stmt], list[Exit | Segment], list[ast.stmt], list[ast.stmt]] | str:
    """``for name in range(stop)`` / ``range(start, stop)``: a hidden counter, the range's
    bounds evaluated once before the loop. Returns (preamble, the exit check, the statements
    that start an iteration, those that end it)."""
    call = loop.iter
    if not (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and call.func.id == "range"
        and 1 <= len(call.args) <= 2
        and not call.keywords
        and isinstance(loop.target, ast.Name)
    ):
        return "only `for name in range(stop)` or `range(start, stop)` loops are captured"
    counter, stop = f"__ptj_k{position}__", f"__ptj_n{position}__"
    start = call.args[0] if len(call.args) == 2 else ast.Constant(0)
    preamble = ast.parse(f"{counter}, {stop} = 0, 0").body
    assign = preamble[0]
    assert isinstance(assign, ast.Assign)
    assign.value = ast.Tuple([start, call.args[-1]], ast.Load())
    head: list[Exit | Segment] = [Exit(ast.parse(f"not {counter} < {stop}", mode="eval").body)]
    name = loop.target.id
    first = ast.parse(f"{name} = {counter}").body
    tail = ast.parse(f"{counter} = {counter} + 1").body
    for node in (*preamble, *first, *tail):
        ast.copy_location(node, loop)
        ast.fix_missing_locations(node)
    return preamble, head, first, tail


def _called_for_effect(node: ast.AST) -> str:
    """The call of an expression statement other than an in-place tensor method on a name
    (``x.mul_(2)``): ``print(...)``, ``history.append(r)``, a logger, a callback."""
    if not isinstance(node, ast.Expr) or not isinstance(node.value, ast.Call):
        return ""
    func = node.value.func
    if (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Name)
        and func.attr.endswith("_")
        and not func.attr.startswith("_")
    ):
        return ""
    return f"`{ast.unparse(func)}`"


def _is_true(test: ast.expr) -> bool:
    return isinstance(test, ast.Constant) and test.value is True


def _negated(test: ast.expr) -> ast.expr:
    return ast.copy_location(ast.UnaryOp(ast.Not(), test), test)


def _break_test(statement: ast.stmt) -> ast.expr | None:
    """``cond`` of ``if cond: break`` (no else), else None."""
    if (
        isinstance(statement, ast.If)
        and not statement.orelse
        and len(statement.body) == 1
        and isinstance(statement.body[0], ast.Break)
    ):
        return statement.test
    return None


def _inside_inner_loop(statement: ast.stmt, target: ast.AST) -> bool:
    for node in ast.walk(statement):
        if isinstance(node, ast.While | ast.For) and node is not statement:
            if any(inner is target for inner in ast.walk(node)):
                return True
    return isinstance(statement, ast.While | ast.For)


def _loads(nodes: Sequence[ast.AST]) -> set[str]:
    return {
        n.id
        for node in nodes
        for n in ast.walk(node)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
    }


def _stores(node: ast.AST) -> set[str]:
    return {
        n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }


def _loads_of(items: tuple[Exit | Segment, ...] | list[Exit | Segment]) -> set[str]:
    return _loads([i.test if isinstance(i, Exit) else s for i in items for s in _parts(i)])


def _parts(item: Exit | Segment) -> tuple[ast.AST, ...]:
    return (item.test,) if isinstance(item, Exit) else item.body


def _reads_before_writes(items: list[Exit | Segment]) -> tuple[set[str], set[str]]:
    """(names an iteration may read before it assigns them, names it assigns)."""
    written: set[str] = set()
    first: set[str] = set()
    writes: set[str] = set()
    for item in items:
        if isinstance(item, Exit):
            first |= _loads([item.test]) - written
            continue
        for statement in item.body:
            if isinstance(statement, ast.AugAssign):
                first |= (_loads([statement.value]) | _stores(statement.target)) - written
            elif isinstance(statement, ast.Assign | ast.AnnAssign):
                value = [statement.value] if statement.value is not None else []
                first |= _loads(value) - written
                targets = (
                    statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                )
                first |= _loads(targets) - written  # x[i] = v reads x
                for target in targets:
                    written |= _stores(target)
            else:  # compound: whatever it reads may come first, what it assigns may not happen
                first |= _loads([statement]) - written
            writes |= _stores(statement)
    return first, writes


def _definitely_assigned(statement: ast.stmt) -> set[str]:
    if isinstance(statement, ast.Assign | ast.AnnAssign | ast.AugAssign):
        return _stores(statement)
    if isinstance(statement, ast.With):
        return {
            n for item in statement.items if item.optional_vars for n in _stores(item.optional_vars)
        } | {n for s in statement.body for n in _definitely_assigned(s)}
    return set()
