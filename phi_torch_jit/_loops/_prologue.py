"""Loop capture, step 2a: the plain assignments right before a captured loop, as one graph.

A solver's set-up before its loop (the first residual, its norm, the counters and flags) would
run as Python, op by op, on every call: in PhiML's CG on a 128x128 grid 15 ops and a sparse
product, about half the time of a warm-started solve that ends in one iteration (docs/loops.md,
NOTE [a compiled prologue]). The longest run of plain assignments right before a captured loop
(``a = expr``, ``a = b = expr``, ``a, b = expr``, ``a += expr``, ``a: T = expr``, to names only,
no comprehension, lambda or call of a captured callee) becomes a function of the local names it
reads that returns the names the loop or later code reads. It is traced per input signature
(``make_fx``) and compiled by the engine's backend, like a block.

What is traced: the tensors among its inputs (and tuples of tensors) as graph inputs; Python
scalars, dtypes and devices as constants of the signature (a new value: a new graph, at most
``MAX_GRAPHS``). Its results are the graph's tensors, its inputs passed through as the same
objects, and Python values computed from the signature (``n = y.shape[0]``); two names bound to
one tensor stay one tensor. The statements run as Python, as written, where any of this does
not hold: an input of another kind, inputs sharing memory, grad mode on (a custom function's
forward and backward run with it off), a trace that fails (``.item()``, a data-dependent
shape), a statement that writes an input in place, a result that is a view of an input or of
another result. Values are the statements' own to float rounding (inductor may fuse
reductions), as for blocks.
"""

from __future__ import annotations

import ast
import copy
import logging
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from .._fast_capture import fast_metadata
from ..errors import NotNow
from ._analysis import _FORBIDDEN, FunctionPlan, _definitely_assigned, _loads, _stores
from ._block import _OWN_LOCK, CaptureFailed

__all__ = ["ProloguePlan", "CapturedPrologue", "with_prologues"]

logger = logging.getLogger("phi_torch_jit")

MIN_STATEMENTS = 2
"""Shorter runs stay Python: a graph call costs about what one or two ops do."""
MAX_GRAPHS = 8
"""Graphs kept per prologue (one per input signature); other signatures run as Python."""
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device)
_SCOPED = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.NamedExpr, ast.Starred)


@dataclass(frozen=True)
class ProloguePlan:
    """The statements before one loop that run as a graph."""

    line: int
    """The first statement's line in the user's file."""
    statements: tuple[ast.stmt, ...]
    inputs: tuple[str, ...]
    """Local names the statements read before they assign them."""
    outputs: tuple[str, ...]
    """Names they assign that the loop or later code reads."""


def with_prologues(
    fn: types.FunctionType, plan: FunctionPlan, callees: set[str]
) -> tuple[FunctionPlan, dict[str, ProloguePlan]]:
    """``plan`` with the prologue of each loop replaced by one call statement (reading the
    name the dict gives), and the prologues by those names. ``callees``: names of called
    functions whose loops are captured (a statement calling one stays Python)."""
    tree = copy.deepcopy(plan.tree)
    local_names = set(fn.__code__.co_varnames) | set(fn.__code__.co_cellvars)
    bound = {a.arg for a in (*tree.args.posonlyargs, *tree.args.args, *tree.args.kwonlyargs)}
    bound |= {a.arg for a in (tree.args.vararg, tree.args.kwarg) if a is not None}
    body: list[ast.stmt] = []
    prologues: dict[str, ProloguePlan] = {}
    loops = []
    done = 0
    for loop in plan.loops:
        start = loop.position
        while start > done and _plain(tree.body[start - 1], callees):
            start -= 1
        found = _planned(tree, start, loop.position, local_names, bound | _bound_in(tree, start))
        body.extend(tree.body[done:start] if found else tree.body[done : loop.position])
        if found:
            name = f"__ptj_prologue{len(prologues)}__"
            prologues[name] = found
            body.append(_call(name, found, tree.body[start]))
        loops.append(replace(loop, position=len(body)))
        done = loop.position
    body.extend(tree.body[done:])
    tree.body = body
    return FunctionPlan(tree, tuple(loops), plan.refused), prologues


def _bound_in(tree: ast.FunctionDef, end: int) -> set[str]:
    """Names surely bound after the first ``end`` statements."""
    return {name for statement in tree.body[:end] for name in _definitely_assigned(statement)}


def _plain(statement: ast.stmt, callees: set[str]) -> bool:
    if isinstance(statement, ast.Assign):
        targets: list[ast.expr] = list(statement.targets)
    elif isinstance(statement, ast.AugAssign | ast.AnnAssign) and statement.value is not None:
        targets = [statement.target]
    else:
        return False
    if not all(_names_only(t) for t in targets):
        return False
    if any(isinstance(n, (*_FORBIDDEN, *_SCOPED)) for n in ast.walk(statement)):
        return False
    return not (_loads([statement]) & callees)


def _names_only(target: ast.expr) -> bool:
    if isinstance(target, ast.Tuple | ast.List):
        return all(_names_only(t) for t in target.elts)
    return isinstance(target, ast.Name)


def _planned(
    tree: ast.FunctionDef, start: int, end: int, local_names: set[str], bound: set[str]
) -> ProloguePlan | None:
    statements = tree.body[start:end]
    if len(statements) < MIN_STATEMENTS:
        return None
    inputs: set[str] = set()
    written: set[str] = set()
    for statement in statements:
        inputs |= (_reads([statement]) - written) & local_names
        written |= _stores(statement)
    if not inputs <= bound:
        return None  # a name that may be unbound: Python raises what it raises
    outputs = written & _reads(tree.body[end:])
    if not outputs:
        return None
    return ProloguePlan(statements[0].lineno, tuple(statements), tuple(sorted(inputs)),
                        tuple(sorted(outputs)))  # fmt: skip


def _reads(nodes: Sequence[ast.stmt]) -> set[str]:
    """Names read by ``nodes``, with ``a += b``'s ``a`` (its ``Name`` is a store)."""
    augmented = {
        n.target.id
        for node in nodes
        for n in ast.walk(node)
        if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name)
    }
    return _loads(nodes) | augmented


def _call(name: str, plan: ProloguePlan, where: ast.stmt) -> ast.stmt:
    (statement,) = ast.parse(f"{_tuple(plan.outputs)} = {name}({', '.join(plan.inputs)})").body
    for node in ast.walk(statement):
        ast.copy_location(node, where)
    return statement


def _tuple(names: Sequence[str]) -> str:
    return f"({', '.join(names)},)" if names else "()"


def python_prologue(fn: types.FunctionType, plan: ProloguePlan) -> Callable[..., tuple[Any, ...]]:
    """The statements as a function of ``plan.inputs`` returning ``plan.outputs``, with the
    user's globals and closure cells (a closure variable rebound later is seen)."""
    free = fn.__code__.co_freevars
    inner = ast.parse(f"def __ptj_prologue__({', '.join(plan.inputs)}):\n    pass").body[0]
    assert isinstance(inner, ast.FunctionDef)
    inner.body = [
        *copy.deepcopy(plan.statements),
        *ast.parse(f"return {_tuple(plan.outputs)}").body,
    ]
    factory = ast.parse(f"def __ptj_factory__({', '.join(free)}):\n    pass").body[0]
    assert isinstance(factory, ast.FunctionDef)
    factory.body = [inner, *ast.parse("return __ptj_prologue__").body]
    module = ast.fix_missing_locations(ast.Module([factory], []))
    code = compile(module, fn.__code__.co_filename, "exec")
    factory_code = next(c for c in code.co_consts if isinstance(c, types.CodeType))
    found = next(c for c in factory_code.co_consts if isinstance(c, types.CodeType))
    cells = dict(zip(free, fn.__closure__ or ()))
    closure = tuple(cells[name] for name in found.co_freevars)
    return types.FunctionType(found, fn.__globals__, "__ptj_prologue__", None, closure)


@dataclass(frozen=True)
class _Graph:
    """A prologue's graph for one input signature and how its results are put together."""

    run: Callable[..., Any]
    results: tuple[Any, ...]
    """Per output: ``("tensor", j)`` the graph's ``j``-th result, ``("input", i)`` the ``i``-th
    input tensor, ``("value", v)`` a Python value, ``("tuple", parts)`` a tuple of those."""


class CapturedPrologue:
    """The runtime of one prologue: graphs per input signature, the statements as Python
    otherwise."""

    def __init__(
        self,
        label: str,
        python: Callable[..., tuple[Any, ...]],
        compile_graph: Callable[[torch.fx.GraphModule, tuple[torch.Tensor, ...]], Any] | None,
        lock: Any = None,
    ) -> None:
        self.label = label
        self.python = python
        self.compile_graph = compile_graph
        self.lock = lock if lock is not None else _OWN_LOCK
        self.graphs: dict[Any, _Graph | str] = {}
        """Per input signature: its graph, or why it runs as Python."""
        self.graph_runs = 0
        """Calls its graphs served (for tests and ``explain()``)."""

    def __call__(self, *values: Any) -> tuple[Any, ...]:
        key = _signature(values)
        graph = None if key is None else self._graph(key, values)
        if graph is None:
            return self.python(*values)
        tensors = _tensors_of(values)
        flat = graph.run(*tensors)
        self.graph_runs += 1
        return tuple(_result(spec, flat, tensors) for spec in graph.results)

    def _graph(self, key: Any, values: tuple[Any, ...]) -> _Graph | None:
        graph = self.graphs.get(key)
        if graph is None:
            if len(self.graphs) >= MAX_GRAPHS or not self.lock.acquire(blocking=False):
                return None
            try:
                graph = self.graphs.get(key) or self._traced(values)
            except NotNow:
                return None
            except Exception as error:  # these inputs run the statements as Python
                graph = f"{type(error).__name__}: {error}".splitlines()[0]
                logger.info(
                    "phi_torch_jit: the statements before the loop of %s run as Python for "
                    "these inputs: %s", self.label, graph,
                )  # fmt: skip
            finally:
                self.lock.release()
            self.graphs[key] = graph
        return None if isinstance(graph, str) else graph

    def _traced(self, values: tuple[Any, ...]) -> _Graph:
        inputs = tuple(t.detach().clone() for t in _tensors_of(values))
        versions = [t._version for t in inputs]
        results: list[tuple[Any, ...]] = []

        def statements(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
            rebuilt = _rebuilt(values, iter(tensors))
            outputs: list[torch.Tensor] = []
            results[:] = [_spec(v, tensors, outputs) for v in self.python(*rebuilt)]
            _no_shared_memory(tensors, outputs)
            return tuple(outputs)

        with torch.no_grad(), fast_metadata():
            graph = make_fx(statements)(*inputs)
        if any(t._version != v for t, v in zip(inputs, versions)):
            raise CaptureFailed("a statement writes an input in place")
        run = graph if self.compile_graph is None else self.compile_graph(graph, inputs)
        return _Graph(run, tuple(results))


def _signature(values: Sequence[Any]) -> Any:
    """The input signature of a call, or None where the statements must run as Python."""
    if torch.is_grad_enabled():
        return None  # a graph's results would not carry autograd history (solvers run without)
    key: list[Any] = []
    memory: set[int] = set()
    for value in values:
        if type(value) is tuple and value and all(type(t) is torch.Tensor for t in value):
            parts = [_tensor_key(t, memory) for t in value]
            if any(p is None for p in parts):
                return None
            key.append(tuple(parts))
        elif type(value) is torch.Tensor:
            part = _tensor_key(value, memory)
            if part is None:
                return None
            key.append(part)
        elif isinstance(value, _SCALARS):
            key.append((type(value), value))
        else:
            return None
    return tuple(key)


def _tensor_key(t: torch.Tensor, memory: set[int]) -> Any:
    if t.layout != torch.strided:
        return None
    if t.numel():
        address = t.untyped_storage().data_ptr()
        if address in memory:
            return None  # inputs sharing memory: a graph takes them as distinct
        memory.add(address)
    return (t.shape, t.stride(), t.dtype, t.device)


def _tensors_of(values: Sequence[Any]) -> list[torch.Tensor]:
    flat: list[torch.Tensor] = []
    for value in values:
        if type(value) is torch.Tensor:
            flat.append(value)
        elif type(value) is tuple and value and all(type(t) is torch.Tensor for t in value):
            flat.extend(value)
    return flat


def _rebuilt(values: Sequence[Any], tensors: Any) -> list[Any]:
    rebuilt: list[Any] = []
    for value in values:
        if type(value) is torch.Tensor:
            rebuilt.append(next(tensors))
        elif type(value) is tuple and value and all(type(t) is torch.Tensor for t in value):
            rebuilt.append(tuple(next(tensors) for _ in value))
        else:
            rebuilt.append(value)
    return rebuilt


def _spec(value: Any, inputs: Sequence[torch.Tensor], outputs: list[torch.Tensor]) -> Any:
    """How a result is rebuilt; its tensors are appended to ``outputs`` once each."""
    if isinstance(value, torch.Tensor):
        for i, t in enumerate(inputs):
            if value is t:
                return ("input", i)
        for j, t in enumerate(outputs):
            if value is t:
                return ("tensor", j)
        outputs.append(value)
        return ("tensor", len(outputs) - 1)
    if type(value) is tuple and all(isinstance(v, torch.Tensor) for v in value):
        return ("tuple", tuple(_spec(v, inputs, outputs) for v in value))
    if isinstance(value, _SCALARS) or type(value) is torch.Size:
        return ("value", value)
    raise CaptureFailed(f"a statement assigns a {type(value).__name__}, not a tensor or scalar")


def _no_shared_memory(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
    """A result that is a view of an input or of another result would be a copy after the
    compile: a later write through it would not reach the other."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    for t in outputs:
        if not t.numel():
            continue
        address = t.untyped_storage().data_ptr()
        if address in seen:
            raise CaptureFailed("a result shares memory with an input or another result")
        seen.add(address)


def _result(spec: Any, flat: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> Any:
    kind, where = spec
    if kind == "tensor":
        return flat[where]
    if kind == "input":
        return inputs[where]
    if kind == "tuple":
        return tuple(_result(s, flat, inputs) for s in where)
    return where
