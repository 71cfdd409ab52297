"""Loop capture, step 2: the function again, each planned loop replaced by a call of its
:class:`~._block.CapturedLoop`, plus per loop an *iteration* and an *enter* function.

``iterate(go, *carried, *invariants) -> (go, *carried)`` runs one iteration under the predicate
``go`` (a 0-d bool tensor): carried values are copied before each segment (so in-place writes
touch copies) and merged back by ``where(go, new, old)``; each exit check turns ``go`` off.
Run eagerly with ``go`` true it computes what the loop body computes; traced ``K`` times in a
row it is a block whose iterations after the exit change nothing. ``enter(*carried,
*invariants)`` is the first exit check (``while test``): whether an iteration runs at all.

Exit tests become tensor expressions: ``bool(x)`` is ``x``, ``and``/``or``/``not`` are logical
ops on 0-d tensors. The new functions share the user's globals and closure cells (a closure
variable rebound later is seen, as in the original).
"""

from __future__ import annotations

import ast
import copy
import itertools
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ._analysis import Exit, FunctionPlan, LoopPlan, Segment

__all__ = ["Rewritten", "rewrite"]

_HELPERS = ("__ptj_merge__", "__ptj_stay__", "__ptj_truth__", "__ptj_clone__", "__ptj_and__",
            "__ptj_or__", "__ptj_not__")  # fmt: skip


@dataclass(frozen=True)
class Rewritten:
    """The rewritten function and, per loop, its iteration and enter functions."""

    function: types.FunctionType
    iterations: tuple[tuple[Callable[..., Any], Callable[..., Any]], ...]


def rewrite(
    fn: types.FunctionType,
    plan: FunctionPlan,
    loops: list[Any],
    helpers: tuple[Any, ...],
    callees: Mapping[str, Any] | None = None,
    cells: Mapping[str, Any] | None = None,
) -> Rewritten:
    """``loops``: a list the caller fills with one runtime object per planned loop (called as
    ``loop(carried_tuple, invariant_tuple)``, returning the new carried tuple). ``callees``:
    functions called by name outside the planned loops, each replaced by the given callable
    (``_callees.Callee``); calls inside a loop's body are left as they are (a block traces
    them). ``cells``: further names the function's statements read, with their values (the
    runtimes of ``_prologue``)."""
    tree = plan.tree
    cells = dict(cells or {})
    callees = dict(callees or {})
    renamed = _Renamed({name: _callee_name(name) for name in callees})
    body: list[ast.stmt] = []
    by_position = {loop.position: (k, loop) for k, loop in enumerate(plan.loops)}
    for position, statement in enumerate(tree.body):
        if position not in by_position:
            body.append(renamed.visit(_copy(statement)) if callees else statement)
            continue
        k, loop = by_position[position]
        body.extend(renamed.visit(_copy(s)) if callees else s for s in loop.preamble)
        carried = _tuple(loop.carried)
        call = f"{carried} = __ptj_loops__[{k}]({carried}, {_tuple(loop.invariants)})"
        body.extend(_located(ast.parse(call).body, statement))
    function = ast.FunctionDef(
        tree.name, tree.args, body or [ast.Pass()], [], tree.returns, type_comment=None
    )
    inner: list[ast.stmt] = [function]
    for k, loop in enumerate(plan.loops):
        inner.extend(_iteration_functions(k, loop))
    names = "".join(f"__ptj_iter{k}__, __ptj_enter{k}__, " for k in range(len(plan.loops)))
    inner.extend(ast.parse(f"__ptj_result__ = ({tree.name}, ({names}))").body)
    unpack = ast.parse(f"{', '.join(_HELPERS)}, = __ptj_helpers__").body
    free = fn.__code__.co_freevars
    calls = tuple(_callee_name(name) for name in callees)
    factory = ast.FunctionDef(
        "__ptj_factory__",
        ast.arguments(
            [],
            [ast.arg(a) for a in ("__ptj_helpers__", "__ptj_loops__", *free, *calls, *cells)],
            None,
            [],
            [],
            None,
            [],
        ),
        [*unpack, *inner, ast.Return(ast.Name("__ptj_result__", ast.Load()))],
        [],
        None,
        type_comment=None,
    )
    module = ast.fix_missing_locations(ast.Module([factory], []))
    code = compile(module, fn.__code__.co_filename, "exec")
    factory_code = next(c for c in code.co_consts if isinstance(c, types.CodeType))
    bound = {name: types.CellType(value) for name, value in zip(_HELPERS, helpers)}
    bound["__ptj_loops__"] = types.CellType(loops)
    bound.update(zip(free, fn.__closure__ or ()))  # the user's own cells: live values
    bound.update((_callee_name(name), types.CellType(c)) for name, c in callees.items())
    bound.update((name, types.CellType(value)) for name, value in cells.items())

    def make(code_name: str) -> types.FunctionType:
        found = next(
            c for c in factory_code.co_consts
            if isinstance(c, types.CodeType) and c.co_name == code_name
        )  # fmt: skip
        closure = tuple(bound[name] for name in found.co_freevars)
        return types.FunctionType(found, fn.__globals__, code_name, None, closure)

    function_object = make(tree.name)
    function_object.__defaults__ = fn.__defaults__
    function_object.__kwdefaults__ = fn.__kwdefaults__
    iterations = tuple(
        (make(f"__ptj_iter{k}__"), make(f"__ptj_enter{k}__")) for k in range(len(plan.loops))
    )
    return Rewritten(function_object, iterations)


def _callee_name(name: str) -> str:
    return f"__ptj_call_{name}__"


class _Renamed(ast.NodeTransformer):
    """Reads of the given names read other names (a callee replaced by its captured form)."""

    def __init__(self, names: Mapping[str, str]) -> None:
        self.names = names

    def visit_Name(self, node: ast.Name) -> Any:
        if isinstance(node.ctx, ast.Load) and node.id in self.names:
            return ast.copy_location(ast.Name(self.names[node.id], ast.Load()), node)
        return node


def _tuple(names: tuple[str, ...]) -> str:
    return f"({', '.join(names)},)" if names else "()"


def _located(nodes: list[ast.stmt], where: ast.stmt) -> list[ast.stmt]:
    for node in nodes:
        for child in ast.walk(node):
            ast.copy_location(child, where)
    return nodes


def _iteration_functions(k: int, loop: LoopPlan) -> list[ast.stmt]:
    carried = _tuple(loop.carried)
    params = ", ".join((*loop.carried, *loop.invariants))
    flags = repr(tuple(name in loop.in_place for name in loop.carried))
    body: list[ast.stmt] = []
    bound = {*loop.carried, *loop.invariants}
    """Names bound at this point of an iteration (an ``if`` may only assign those)."""
    for item in loop.items:
        if isinstance(item, Exit):
            body.extend(ast.parse("__ptj_go__ = __ptj_stay__(__ptj_go__, 0)").body)
            assign = body[-1]
            assert isinstance(assign, ast.Assign) and isinstance(assign.value, ast.Call)
            assign.value.args[1] = _Tensorize().visit(_copy(item.test))
            continue
        assert isinstance(item, Segment)
        start = f"__ptj_old__ = {carried}\n__ptj_new__ = {carried} = __ptj_clone__(__ptj_old__)"
        body.extend(ast.parse(start).body)
        for statement in item.body:
            body.extend(_predicated(_flags_as_tensors(_copy(statement)), bound))
            bound |= _assigned_names(statement)
        merge = (
            f"{carried} = __ptj_merge__(__ptj_go__, {carried}, __ptj_old__, __ptj_new__, {flags})"
        )
        body.extend(ast.parse(merge).body)
    body.extend(ast.parse(f"return (__ptj_go__, *{carried})").body)
    iterate = ast.parse(f"def __ptj_iter{k}__(__ptj_go__, {params}):\n    pass").body[0]
    assert isinstance(iterate, ast.FunctionDef)
    iterate.body = body
    first = loop.items[0]
    test = _Tensorize().visit(_copy(first.test)) if isinstance(first, Exit) else ast.Constant(False)
    enter = ast.parse(f"def __ptj_enter{k}__({params}):\n    return __ptj_stay__(True, 0)").body[0]
    assert isinstance(enter, ast.FunctionDef)
    ret = enter.body[0]
    assert isinstance(ret, ast.Return) and isinstance(ret.value, ast.Call)
    ret.value.args[1] = test
    return [iterate, enter]


_IF_NUMBERS = itertools.count()


def _predicated(statement: ast.stmt, bound: set[str]) -> list[ast.stmt]:
    """An ``if`` inside the body whose branches only assign names bound before it, as both
    branches computed on copies and merged by ``where(test, then, else)``: a tensor-valued
    test is then no value read on the host. Other statements are kept as they are."""
    if not isinstance(statement, ast.If) or not _only_assignments(statement):
        return [statement]
    names = tuple(sorted(_assigned_names(statement)))
    if not names or not set(names) <= bound:
        return [statement]
    k = next(_IF_NUMBERS)
    values = _tuple(names)
    flags = repr((True,) * len(names))
    test = _Tensorize().visit(statement.test)
    then_branch = [_predicated(s, bound) for s in statement.body]
    else_branch = [_predicated(s, bound) for s in statement.orelse]
    code = [
        f"__ptj_if{k}__ = __ptj_truth__(0)",
        f"__ptj_keep{k}__ = {values}",
        f"{values} = __ptj_clone__(__ptj_keep{k}__)",
    ]
    result = ast.parse("\n".join(code)).body
    call = result[0]
    assert isinstance(call, ast.Assign) and isinstance(call.value, ast.Call)
    call.value.args[0] = test
    result.extend(s for part in then_branch for s in part)
    result.extend(
        ast.parse(f"__ptj_then{k}__ = {values}\n{values} = __ptj_clone__(__ptj_keep{k}__)").body
    )
    result.extend(s for part in else_branch for s in part)
    merged = (
        f"{values} = __ptj_merge__(__ptj_if{k}__, __ptj_then{k}__, {values}, {values}, {flags})"
    )
    result.extend(ast.parse(merged).body)
    return result


def _flags_as_tensors(statement: ast.stmt) -> ast.stmt:
    """``done = bool(err < tol) or n >= 100`` as a 0-d bool tensor: a flag the loop tests
    (``while not done``) is then no value read on the host. Only assignments whose value calls
    ``bool()``; the flag is a Python bool again after the loop."""
    if isinstance(statement, ast.Assign | ast.AugAssign | ast.AnnAssign) and statement.value:
        calls_bool = any(
            isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "bool"
            for n in ast.walk(statement.value)
        )
        if calls_bool:
            statement.value = _Tensorize().visit(statement.value)
    return statement


def _only_assignments(statement: ast.If) -> bool:
    for child in (*statement.body, *statement.orelse):
        if isinstance(child, ast.If):
            if not _only_assignments(child):
                return False
        elif not isinstance(child, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Pass):
            return False
    return True


def _assigned_names(statement: ast.stmt) -> set[str]:
    return {
        n.id
        for n in ast.walk(statement)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }


def _copy(node: Any) -> Any:
    return copy.deepcopy(node)


class _Tensorize(ast.NodeTransformer):
    """An exit test as a tensor expression: no ``bool()`` or Python ``and``/``or``/``not``,
    which would read the value on the host."""

    def visit_Call(self, node: ast.Call) -> Any:
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id == "bool" and len(node.args) == 1:
            return ast.Call(ast.Name("__ptj_truth__", ast.Load()), node.args, [])
        return node

    def visit_BoolOp(self, node: ast.BoolOp) -> Any:
        self.generic_visit(node)
        helper = "__ptj_and__" if isinstance(node.op, ast.And) else "__ptj_or__"
        return ast.Call(ast.Name(helper, ast.Load()), node.values, [])

    def visit_UnaryOp(self, node: ast.UnaryOp) -> Any:
        self.generic_visit(node)
        if isinstance(node.op, ast.Not):
            return ast.Call(ast.Name("__ptj_not__", ast.Load()), [node.operand], [])
        return node
