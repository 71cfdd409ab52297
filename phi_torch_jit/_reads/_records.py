"""Stage 1 (reads), its records: where a read value lives and how it is guarded.

Plain data shared by the guard stage (:mod:`._python`), the side-effect snapshot
(:mod:`._mutations`) and the wrapper (which rebinds tensor sources while tracing). See NOTE
[Python reads] and NOTE [attribute paths] in docs/design.md.
"""

from __future__ import annotations

import enum
import functools
import types
from dataclasses import dataclass, replace
from typing import Any

import torch

from ._canonical import EXPRESSIONS, FORMS, decoded, form_of

__all__ = ["Kind", "Source", "Step", "LENGTH", "LISTED", "canonical", "Read", "GONE",
           "PRIMITIVES", "same_value", "immutable", "enum_attributes", "tensor_meta",
           "array_copy", "same_array", "PYTHONS_OWN"]  # fmt: skip

PRIMITIVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
"""Values guarded by value."""
GONE = Exception
"""What reading a source may raise: a name or entry gone (KeyError, AttributeError...), or
anything a user object's attribute access raises. Either way the guard fails, and the next
record pass runs the user's code, which raises where eager code would."""


class Kind(enum.Enum):
    """How a read value is guarded."""

    VALUE = "value"
    """Immutable: compared by value."""
    CONTENT = "content"
    """A small container of immutable values: compared by content (a snapshot)."""
    IDENTITY = "identity"
    """Any other object: must be the same object."""
    ARRAY = "array"
    """A NumPy array of up to ``_MAX_ARRAY`` elements: compared by content (a copy)."""
    TENSOR = "tensor"
    """A tensor: an input of the compiled program, guarded by its metadata."""
    ITERATOR = "iterator"
    """An iterator or generator (``next(forcing)``): each call takes new items, which no
    compiled program repeats; a specialization that reads one runs eagerly."""
    DRAWS = "draws"
    """A random generator, a method bound to one, or a clock (``from random import random``,
    ``rng.normal``, ``from time import perf_counter``): each call draws anew, which no compiled
    program repeats; a specialization that reads one runs eagerly."""


@dataclass(frozen=True)
class Source:
    """Where a read value lives: a globals dict entry (or a partial's keywords), a closure
    cell, or an object the jitted callable holds (a partial's argument, a method's ``self``,
    the jitted module itself)."""

    label: str
    """``global dt`` or ``closure dt``, for messages."""
    location: str
    """``file:line`` of the first read."""
    namespace: dict[str, Any] | None = None
    """The globals dict (for a global)."""
    name: str = ""
    """The global's name."""
    cell: types.CellType | None = None
    """The cell (for a closure variable)."""
    path: tuple[Step, ...] = ()
    """Attribute and item steps from the global or cell to the value (``cfg.solver.tol``,
    ``TABLE["solver"]["tol"]``): NOTE [attribute paths]."""
    holder: Any = None
    """The object itself, for an object the jitted callable holds (neither a namespace
    entry nor a cell: it cannot be rebound, only changed)."""
    private: bool = False
    """Logged and explained without its values (the environment may hold secrets)."""

    def get(self) -> Any:
        """The current value (KeyError / ValueError / AttributeError if it no longer exists)."""
        value = self._root()
        for step in self.path:
            if step.length:
                value = len(value)
            elif step.text:
                value = FORMS[step.key](value)
            elif step.listed:
                value = tuple(value)
            else:
                value = getattr(value, step.key) if step.attribute else value[step.key]
                if step.call:
                    value = value() if step.argument is None else value(step.argument)
        return value

    def _root(self) -> Any:
        if self.cell is not None:
            return self.cell.cell_contents
        if self.namespace is not None:
            return self.namespace[self.name]
        return self.holder

    def set(self, value: Any) -> None:
        """Rebind it (used while tracing, to put a traced input in place of a tensor)."""
        if self.path:
            owner = self.above(-1).get()
            last = self.path[-1]
            if last.attribute:
                setattr(owner, last.key, value)
            else:
                owner[last.key] = value
        elif self.cell is not None:
            self.cell.cell_contents = value
        else:
            assert self.namespace is not None, "an object held by the callable is not rebound"
            self.namespace[self.name] = value

    def in_tuple(self) -> bool:
        """Whether the value is an item of a tuple, which :meth:`set` cannot rebind (a new
        tuple would change the identity its guard holds)."""
        last = self.path[-1] if self.path else None
        if last is None or last.attribute or last.length or last.text or last.listed:
            return False
        return isinstance(self.above(-1).get(), tuple)

    def above(self, n: int) -> Source:
        """The source of what the first ``n`` steps of the path lead to (``-1``: the owner
        of the value)."""
        return replace(self, path=self.path[:n])

    def child(self, step: Step) -> Source:
        """The source one attribute or item further."""
        if step.length:
            label = f"len({self.label})"
        elif step.text:
            label = self.label  # compared in canonical form: the same value for messages
        elif step.listed:
            label = f"list({self.label})"
        else:
            label = self.label + (f".{step.key}" if step.attribute else f"[{step.key!r}]")
            label += _called(step)
        return Source(label, self.location, self.namespace, self.name, self.cell,
                      (*self.path, step), self.holder, self.private)  # fmt: skip

    def expression(self, root: str) -> str:
        """Python code reading it, given code ``root`` reading the global, cell or object."""
        for step in self.path:
            root = step.expression(root)
        return root


@dataclass(frozen=True)
class Step:
    """One step of an attribute path."""

    attribute: bool
    """``.key`` (True) or ``[key]`` (False)."""
    key: Any
    """An identifier, or a str/int dict key."""
    length: bool = False
    """``len()`` of the value instead (a list's or dict's length: an append is a change)."""
    call: bool = False
    """Call the attribute (``var.get()`` of a ``contextvars.ContextVar``)."""
    argument: str | int | None = None
    """With ``call``: the one argument to call it with (``var.get(UNSET)``, a cache's
    ``hits.__ge__(3)``)."""
    listed: bool = False
    """``tuple()`` of the value instead: a set's members in its order (``list(S)[i]``)."""
    text: bool = False
    """The value in a canonical form instead (:func:`canonical`; ``key`` names which): equal
    only if the types, signs and order agree (``2`` and ``2.0``, ``-0.0`` and ``0.0``,
    ``{"a": 1, "b": 2}`` and ``{"b": 2, "a": 1}`` are ``==``, but a program that read them
    may differ)."""

    def expression(self, owner: str) -> str:
        """Python code taking this step from code ``owner``."""
        if self.length:
            return f"len({owner})"
        if self.text:
            return EXPRESSIONS[self.key].format(owner)
        if self.listed:
            return f"tuple({owner})"
        owner += f".{self.key}" if self.attribute else f"[{self.key!r}]"
        return owner + _called(self)


LENGTH = Step(False, None, length=True)
LISTED = Step(False, None, listed=True)
UNSET = "<no value>"
"""What a ``contextvars.ContextVar`` that holds no value reads as (``var.get(UNSET)``)."""


def _called(step: Step) -> str:
    """The call a step makes, as code (``()``, ``('<no value>')``), or ""."""
    if not step.call:
        return ""
    return "()" if step.argument is None else f"({step.argument!r})"


@dataclass(frozen=True)
class Read:
    """One Python value the function read, and how it is guarded."""

    source: Source
    """Where it lives."""
    kind: Kind
    """How it is compared."""
    expected: Any
    """The value (VALUE), a snapshot (CONTENT), the object (IDENTITY) or the tensor's
    ``(shape, dtype, device, requires_grad, strides)`` (TENSOR: Python may read ``stride()``
    or ``is_contiguous()``, as of an argument)."""
    unguarded: str = ""
    """What under an IDENTITY read is not guarded (fields beyond the walk's limit), for
    :meth:`JitFunction.explain`; empty when its whole tree is."""

    def current(self) -> Any:
        """What :attr:`expected` is compared with now."""
        value = self.source.get()
        if self.kind is Kind.TENSOR:
            return tensor_meta(value)
        return value

    def holds(self) -> bool:
        try:
            now = self.current()
        except GONE:
            return False
        if self.kind in (Kind.IDENTITY, Kind.ITERATOR, Kind.DRAWS):
            return now is self.expected
        return same_value(now, self.expected)

    def describe(self) -> str:
        if self.source.private:
            return f"{self.source.label} (read at {self.source.location}): changed"
        # a value compared in its canonical form (canonical()) is shown as the value it is
        last = self.source.path[-1] if self.source.path else None
        shown = functools.partial(decoded, last.key) if last is not None and last.text else _shown
        try:
            now = shown(self.current())
        except GONE:
            now = "<deleted>"
        where = f"{self.source.label} (read at {self.source.location})"
        return f"{where}: {shown(self.expected)} -> {now}"


def _shown(value: Any) -> str:
    return repr(_short(value))


def canonical(value: Any) -> tuple[Step, bytes | str]:
    """The step that reads ``value`` in a form that differs wherever a program reading it
    may, and that form now: ``marshal``'s bytes (exact types, a float's bits, the order of a
    dict; 0.3 us for a small config dict, 2 us for 20 entries), a set's as the tuple of its
    order (marshal sorts it), a container holding sets or dict subclasses with each in its
    order (``_canonical._in_order``), or, for what marshal does not write (a deque, an enum),
    ``repr()`` (which lists a set in its order). ``==`` would call ``2`` and ``2.0``,
    ``-0.0`` and ``0.0``, ``1`` and ``True``, and two orders of a dict or a set equal. A
    later value that marshal cannot write raises ValueError in the guard: a change."""
    key = form_of(value)
    try:
        return Step(False, key, text=True), FORMS[key](value)
    except ValueError:
        return Step(False, "repr", text=True), repr(value)


def _short(value: Any) -> Any:
    text = repr(value)
    return value if len(text) <= 60 else f"<{type(value).__name__} object>"


class ArrayState:
    """A NumPy array as a trace saw it: its bytes (``-0.0`` apart from ``0.0``), class,
    dtype with its field names (``R.dtype.names = ...`` renames in place, a copy shares the
    dtype), strides and flags (``A.flags.writeable``, an equal array in Fortran order: code
    may branch on them, ``torch.from_numpy`` keeps the strides) and the plain attributes of a
    subclass's instance (``A.scale``)."""

    def __init__(self, value: Any) -> None:
        self.copy = value.copy()
        self.bytes = value.tobytes()
        self.form = _array_form(value)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ArrayState):
            return self.form == other.form and self.bytes == other.bytes
        return same_array(other, self)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self.copy)


def _array_form(value: Any) -> tuple[Any, ...]:
    flags = value.flags
    own = getattr(value, "__dict__", None) or {}
    attributes = tuple((k, v if immutable(v) else id(v)) for k, v in own.items())
    return (type(value), value.dtype.descr, value.shape, value.strides, flags.writeable,
            flags.c_contiguous, flags.f_contiguous, attributes)  # fmt: skip


def array_copy(value: Any) -> ArrayState:
    return ArrayState(value)


def same_array(a: Any, b: Any) -> bool:
    """Whether the array ``a`` read now is as ``b`` (an :class:`ArrayState`, or an array)."""
    if not isinstance(b, ArrayState):
        b = ArrayState(b)
    if isinstance(a, ArrayState):
        return bool(a == b)
    try:
        return bool(_array_form(a) == b.form and a.tobytes() == b.bytes)
    except Exception:  # not an array any more
        return False


@functools.lru_cache(maxsize=256)
def _answers_any_name(klass: Any) -> bool:
    """Whether ``klass`` answers attribute reads in Python (``__getattr__`` or
    ``__getattribute__``: a config object counting its reads); modules' own aside."""
    if issubclass(klass, (torch.nn.Module, type)):
        return False
    names = ("__getattr__", "__getattribute__")
    return any(isinstance(vars(k).get(n), types.FunctionType) for k in klass.__mro__ for n in names)


def probe(value: Any, name: str, default: Any = None) -> Any:
    """``getattr(value, name, None)`` for the walk's questions (``__wrapped__``, ``dtype``,
    ``__array_interface__``): it does not run a ``__getattr__`` of the object's class, which
    would answer any name (and may count its reads, as the step's own would), and survives a
    lookup raising something else than AttributeError (a config class reading a dict)."""
    try:
        klass: Any = type(value)
        if _answers_any_name(klass):
            return object.__getattribute__(value, name)
        return getattr(value, name, default)
    except Exception:
        return default


def same_value(a: Any, b: Any) -> bool:
    """Whether a value read now equals the one a trace saw: same type, equal (NaN equals
    NaN, arrays element-wise with their dtype); comparisons that raise are not equal."""
    if hasattr(a, "__array_interface__"):
        return same_array(a, b)
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # comparisons that raise: not provably equal
        return False


def tensor_meta(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return ("not a tensor", type(value).__name__)
    return (tuple(value.shape), value.dtype, value.device, value.requires_grad, value.stride())


_ENUM_OWN = frozenset({"_value_", "_name_", "_sort_order_"})


def enum_attributes(member: enum.Enum) -> list[str]:
    """The attributes an enum member holds beyond its value and name: set by the class's
    ``__init__`` or later (``Mode.A.factor = 2.0``), state like any object's."""
    return [
        name
        for name in getattr(member, "__dict__", {})
        if name not in _ENUM_OWN and name.isidentifier()
        and not (name.startswith("__") and name.endswith("__"))
    ]  # fmt: skip


def immutable(value: Any) -> bool:
    """Whether a value can be guarded by value: numbers, strings, None, enums, dtypes,
    devices, and tuples or frozensets of these. Not an instance of a subclass of these that
    holds attributes (``class Knob(float)`` with ``knob.offset``: its attributes are state,
    probe round 35), nor an ``IntEnum`` member that does."""
    if isinstance(value, enum.Enum):  # a member is one object, but its value may hold a list,
        return immutable(value.value) and not enum_attributes(value)  # and it may hold state
    if isinstance(value, PRIMITIVES):
        return type(value) in PRIMITIVES or not getattr(value, "__dict__", None)
    if type(value) in (tuple, frozenset):
        return all(immutable(v) for v in value)
    return False


PYTHONS_OWN = frozenset(
    f"__{n}__" for n in ("dict weakref module doc qualname annotations annotate slots hash "
                         "dataclass_fields dataclass_params match_args orig_bases orig_class "
                         "parameters abstractmethods firstlineno static_attributes type_params "
                         "classcell protocol_attrs non_callable_proto_members final "
                         "callable_proto_members_only").split()
)  # fmt: skip
"""What Python and its library put in a class's, an instance's or a function's ``__dict__``
under ``__x__`` names; others are the user's (``fn.__opts__``, a class's ``__config__``:
probe 39a), walked like any attribute."""
