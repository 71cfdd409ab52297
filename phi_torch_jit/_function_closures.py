"""Tensors an ``autograd.Function`` class closes over, as inputs of its custom function.

Iterative-solver libraries define their Function class inside the function that calls it, a new
class on every call, whose ``forward``/``backward`` close over that call's objects (``op =
Op(a)``; ``x = cg(op, b)``). Compiled as it was recorded, the class would keep the first call's
matrix. Instead, a :class:`ClosurePlan` names where each tensor sits in the closures (a cell,
then attributes and items of the objects it holds, two levels deep): the call passes those
tensors after its own arguments, so they are inputs of the custom op like the arguments (the
trace pass takes them from *its* class, whose objects hold the traced values), and the forward
and backward run the recorded class with its objects holding the op's inputs in their place
(:meth:`ClosurePlan.swapped`).

Only tensors vary this way: everything else those objects hold was computed by the step's
Python from guarded state or value-guarded reads, so a compiled program may keep it. Eager
autograd gives closed-over tensors no gradient through the Function; the custom function
returns None for them too.

Contract: :func:`plan_closures` returns a plan, or a reason why none can be made, for which
the specialization runs eagerly, warned: a tensor in a tuple (a partial's arguments) or as a
bound method's object, deeper than two levels, in a default value of the class's methods or
in a class attribute (``F.M = A``). Objects with ``__slots__`` are walked like others.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .extend import ClosureRoot

__all__ = ["ClosurePlan", "plan_closures", "plan_library_closures", "LIBRARY_DEPTH"]

_METHODS = ("forward", "setup_context", "backward", "jvp")

Step = tuple[str, Any]
"""``("attr", name)`` or ``("item", key)``."""


@dataclass(frozen=True)
class _Path:
    method: str
    cell: int
    steps: tuple[Step, ...]

    def describe(self) -> str:
        return "".join(
            f".{key}" if kind == "attr" else f".__closure__[{key}]" if kind == "closure"
            else f"[{key!r}]"
            for kind, key in self.steps
        )  # fmt: skip


@dataclass(frozen=True)
class ClosurePlan:
    """Where the tensors of a Function class's closures sit, in a fixed order."""

    paths: tuple[_Path, ...]

    def __len__(self) -> int:
        return len(self.paths)

    def tensors_of(self, cls: type) -> tuple[torch.Tensor, ...]:
        """The tensors at the plan's places in ``cls``'s closures (same code, another call)."""
        found = []
        for path in self.paths:
            value = _get(*_place(cls, path))
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"no tensor at {path.describe()} of {cls.__qualname__}")
            found.append(value)
        return tuple(found)

    @contextmanager
    def swapped(self, cls: type, tensors: tuple[torch.Tensor, ...]) -> Iterator[None]:
        """Run a block with ``tensors`` at the plan's places in ``cls``'s closures."""
        undo: list[tuple[Any, Step, Any]] = []
        try:
            for path, tensor in zip(self.paths, tensors):
                holder, step = _place(cls, path)
                undo.append((holder, step, _get(holder, step)))
                _set(holder, step, tensor)
            yield
        finally:
            for holder, step, value in reversed(undo):
                _set(holder, step, value)


def _place(cls: type, path: _Path) -> tuple[Any, Step]:
    """(what holds the path's tensor, the last step to it)."""
    holder: Any = _cell(cls, path)
    step: Step = ("cell", None)
    for next_step in path.steps:
        holder = _get(holder, step)
        step = next_step
    return holder, step


def _cell(cls: type, path: _Path) -> Any:
    return _function(cls, path.method).__closure__[path.cell]  # type: ignore[union-attr]


def _get(holder: Any, step: Step) -> Any:
    kind, key = step
    if kind == "cell":
        return holder.cell_contents
    if kind == "closure":
        return holder.__closure__[key].cell_contents
    if kind == "attr":
        return getattr(holder, key)
    return holder[key]


def _set(holder: Any, step: Step, value: Any) -> None:
    kind, key = step
    if kind == "cell":
        holder.cell_contents = value
    elif kind == "closure":
        holder.__closure__[key].cell_contents = value
    elif kind == "attr":  # frozen dataclasses and slots too: the record pass's own objects
        if key in getattr(holder, "__dict__", ()):
            vars(holder)[key] = value
        else:
            object.__setattr__(holder, key, value)
    else:
        holder[key] = value


def _function(cls: type, method: str) -> Any:
    attribute = cls.__dict__.get(method)
    return getattr(attribute, "__func__", attribute)


def _children(value: Any) -> list[tuple[Step, Any]]:
    """What a walk looks into: items of lists, tuples and dicts, the closure
    cells of functions, the object of a bound method, the attributes of other objects."""
    if isinstance(value, (type, str, bytes, types.ModuleType, torch.Tensor)):
        return []
    if isinstance(value, (list, tuple)):
        return [(("item", i), v) for i, v in enumerate(value[:32])]
    if isinstance(value, dict):
        return [(("item", k), v) for k, v in list(value.items())[:32]]
    found: list[tuple[Step, Any]] = []
    if isinstance(value, types.FunctionType):
        for i, cell in enumerate(value.__closure__ or ()):
            try:
                found.append((("closure", i), cell.cell_contents))
            except ValueError:
                continue
        return found
    if isinstance(value, types.MethodType):
        return [(("attr", "__self__"), value.__self__)]
    if isinstance(value, functools.partial):  # its arguments (a tuple) and keywords
        return [(("attr", "args"), value.args), (("attr", "keywords"), value.keywords)]
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict):
        found = [(("attr", k), v) for k, v in list(attributes.items())[:32]]
    for klass in type(value).__mro__[:-1]:  # __slots__ (dataclass(slots=True) too)
        for name in getattr(klass, "__slots__", ()):
            if name not in ("__dict__", "__weakref__") and hasattr(value, name):
                found.append((("attr", name), getattr(value, name)))
    return found


def _cost(step: Step) -> int:
    """Levels a step descends: a function's closure cell or a bound method's object is the
    same level (an indirection, not a container)."""
    return 0 if step[0] == "closure" or step == ("attr", "__self__") else 1


def _reaches_tensor(value: Any) -> bool:
    """Whether a tensor sits anywhere under ``value`` (a bounded walk, any depth)."""
    return bool(_tensor_steps(value, 8, _Budget(512)))


class _Budget:
    """Objects a walk has visited (each once), and how many it may still visit."""

    def __init__(self, limit: int = 4096) -> None:
        self.seen: set[int] = set()
        self.left = limit

    def enter(self, value: Any) -> bool:
        if id(value) in self.seen or self.left == 0:
            return False
        self.seen.add(id(value))
        self.left -= 1
        return True


def plan_closures(cls: type) -> ClosurePlan | str:
    """The plan for ``cls``'s closed-over tensors, or why none can be made."""
    paths: list[_Path] = []
    seen: set[int] = set()
    budget = _Budget()
    for method in _METHODS:
        function = _function(cls, method)
        code = getattr(function, "__code__", None)
        for index, cell in enumerate(getattr(function, "__closure__", None) or ()):
            if id(cell) in seen:  # forward and backward share the cells of the same names
                continue
            seen.add(id(cell))
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            name = code.co_freevars[index] if code else "?"
            found = _tensor_steps(value, 2, budget)
            if isinstance(found, str):
                return f"{name}{found}"
            paths += [_Path(method, index, steps) for steps in found]
        defaults = getattr(function, "__defaults__", None) or ()
        keywords = getattr(function, "__kwdefaults__", None) or {}
        for default in (*defaults, *keywords.values()):
            if _reaches_tensor(default):
                return f" (a default of {method}) holds a tensor"
    for name, value in vars(cls).items():  # cls.M = A, read as F.M by forward
        if name.startswith("__") or callable(value) or isinstance(value, staticmethod):
            continue
        if _reaches_tensor(value):
            return f" (class attribute {name}) holds a tensor"
    return ClosurePlan(tuple(paths))


LIBRARY_DEPTH = 5
"""Levels below a library's closure root walked for tensors: a PhiML solve's initial guess
sits at ``["solve"].x0._native`` (three), a stacked one at ``._tensors[i]._native`` (five)."""


def plan_library_closures(cls: type, roots: Sequence[ClosureRoot]) -> ClosurePlan | str:
    """The plan for the tensors under ``roots`` (a library's word on where the call's own
    values sit in ``cls``'s closures, :meth:`~phi_torch_jit.extend.Library.closure_roots`),
    or why none can be made (a root that is not there: the library changed)."""
    paths: list[_Path] = []
    budget = _Budget()
    for method, cell, steps in roots:
        path = _Path(method, cell, tuple(steps))
        try:
            holder, step = _place(cls, path)
            value = _get(holder, step)
        except (AttributeError, IndexError, KeyError, TypeError, ValueError):
            return f" (its library's closure root {method}{path.describe()}) is not there"
        found = _tensor_steps(value, LIBRARY_DEPTH, budget)
        if isinstance(found, str):
            return f"{path.describe()}{found}"
        paths += [_Path(method, cell, (*path.steps, *rest)) for rest in found]
    return ClosurePlan(tuple(paths))


def _tensor_steps(value: Any, depth: int, budget: _Budget) -> list[tuple[Step, ...]] | str:
    """The steps to each tensor in ``value``; a str (where) for one that cannot be replaced."""
    if isinstance(value, torch.Tensor):
        return [()]
    steps: list[tuple[Step, ...]] = []
    if not budget.enter(value):
        return steps
    for step, item in _children(value):
        if depth - _cost(step) < 0:
            if _reaches_tensor(item):  # a tensor deeper down: not replaced
                return f".{step[1]} holds a tensor deeper than two levels"
            continue
        inner = _tensor_steps(item, depth - _cost(step), budget)
        where = f".{step[1]}" if step[0] == "attr" else f"[{step[1]!r}]"
        if isinstance(inner, str):
            return where + inner
        if () in inner and (isinstance(value, tuple) or step == ("attr", "__self__")):
            return f"{where} is a tensor in a tuple or a bound method's object"
        steps += [(step, *rest) for rest in inner]
    return steps
