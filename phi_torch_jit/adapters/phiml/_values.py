"""PhiML / PhiFlow values as arguments and results of jitted functions (a value type, ``extend``).

PhiML tensors, fields, geometries and other PhiML tree nodes are split with PhiML's own tree
functions into native tensors and a static structure -- shapes, dimension names,
extrapolations, bounds -- that becomes part of the cache key (:class:`PhiKey`). Torch natives
are traced; natives of other backends (numpy arrays of a geometry built from Python numbers) are
constants in the key, compared by value. PhiML is imported only when such a value is met.
"""

from __future__ import annotations

import functools
import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["is_phiml", "PhiKey", "disassemble", "assemble"]

_MODULES = ("phiml.", "phi.")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def is_phiml(obj: Any) -> bool:
    """Whether ``obj`` is a PhiML/PhiFlow value (decided by its class's module, cheaply)."""
    return type(obj).__module__.startswith(_MODULES)


def _comparable(constant: Any) -> Any:
    """A hashable, comparable stand-in for a constant native (numpy array or number)."""
    if hasattr(constant, "tobytes"):
        return (type(constant).__name__, str(constant.dtype), constant.shape, constant.tobytes())
    return (type(constant).__name__, constant)


class PhiKey:
    """The static part of a PhiML value: hashable by its shapes, equal by its whole structure."""

    __slots__ = ("_hash", "assembler", "constants", "converted", "metas", "shapes", "slots",
                 "specs", "tree")  # fmt: skip

    def __init__(
        self,
        tree: Any,
        shapes: tuple[Any, ...],
        specs: tuple[Any, ...],
        natives: Sequence[Any],
        converted: bool = False,
    ) -> None:
        self.tree = tree
        self.converted = converted
        """Whether float natives of other backends became torch tensors (:func:`_as_traced`):
        the record pass must then run on the converted values, as the trace does."""
        self.shapes = shapes
        self.specs = tuple(_frozen(s) for s in specs)
        """PhiML's per-tensor specs, lists made tuples (PhiML hands back dimension names as a
        list where the input had a tuple: the same layout must not retrace)."""
        self.slots = tuple(None if isinstance(n, torch.Tensor) else n for n in natives)
        """Per native: None for a traced torch tensor, else the constant itself."""
        self.constants = tuple(_comparable(n) for n in self.slots if n is not None)
        self.metas = tuple(
            (tuple(n.shape), n.dtype, n.device, n.requires_grad)
            for n in natives
            if isinstance(n, torch.Tensor)
        )
        """Shape, dtype, device and requires_grad of each traced native, as for plain tensors."""
        self._hash = hash((shapes, self.metas))
        self.assembler: Callable[[list[Any]], list[Any]] | None = None
        """Builds the values from natives faster than PhiML's ``assemble_tensors`` (made at
        the first :func:`assemble` of this key: :func:`_assembler`)."""

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PhiKey):
            return NotImplemented
        if self.metas != other.metas:
            return False
        if self.shapes is not other.shapes and self.shapes != other.shapes:
            return False  # PhiML's Shape comparison: 0.1-0.2 ms a key, once per pair (below)
        if self.constants != other.constants:
            return False
        self.shapes = other.shapes  # equal: shared, the next comparison is one identity test
        if self.specs is other.specs and self.tree is other.tree:
            return True
        equal = _same(self.specs, other.specs) and _same(self.tree, other.tree)
        if equal:  # share one structure: NOTE [PhiML bridge], equal keys adopt one structure
            self.specs, self.tree = other.specs, other.tree
        return equal

    def difference(self, other: PhiKey) -> str:
        """What differs from ``other``, e.g. ``native 0 dtype int64 -> float32``."""
        fields = ("shape", "dtype", "device", "requires_grad")
        for i, (old, new) in enumerate(zip(self.metas, other.metas)):
            changes = [f"{f} {x} -> {y}" for f, x, y in zip(fields, old, new) if x != y]
            if changes:
                return f"PhiML native {i} " + ", ".join(changes)
        for name, old, new in (
            ("shape", self.shapes, other.shapes),
            ("layout", self.specs, other.specs),
            ("constants", self.constants, other.constants),
        ):
            if not _same(old, new):
                return f"PhiML {name}: {_short(old)} -> {_short(new)}"
        return f"PhiML structure: {_short(self.tree)} -> {_short(other.tree)}"

    def __repr__(self) -> str:
        shapes = ", ".join(_ANSI.sub("", str(shape)) for shape in self.shapes)
        return f"PhiML[{shapes}]"


def _same(old: Any, new: Any) -> bool:
    """Whether two parts of keys are equal. PhiML tensors in them (the indices of a sparse
    matrix, built anew with the same pattern every call) are compared by shape and value, as
    PhiML compares its own keys: by ``==`` they answer a tensor, whose truth raised (probe
    round 34: the second call's retrace message crashed). What cannot be compared is not
    equal."""
    try:
        return bool(old == new)  # no tensor in them: the common case, on every call
    except Exception:
        pass
    from phiml.math._tensors import equality_by_shape_and_value

    try:
        with equality_by_shape_and_value(equal_nan=True):
            return bool(old == new)
    except Exception:
        return False


def _frozen(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in value.items()}
    return value


def _short(value: Any) -> str:
    text = _ANSI.sub("", str(value))
    return text if len(text) <= 80 else text[:77] + "..."


def disassemble(obj: Any, tensors: list[torch.Tensor]) -> PhiKey:
    """Append the torch tensors of ``obj`` to ``tensors``; return its static structure.

    A value this module assembled (a program's output, passed to the next step) is not taken
    apart again: its key and tensors are known (:func:`_remembered`)."""
    known = _remembered(obj)
    if known is not None:
        key, natives = known
        tensors.extend(natives)
        return key
    from phiml.math._tensors import disassemble_tensors
    from phiml.math._tree import disassemble_tree

    tree, values = disassemble_tree(obj, cache=False, attr_type=_traced_attributes)
    # expand: natives in PhiML's canonical layout (as PhiML's own jit keys them), so a state made
    # by eager code and one made by the program share a key (no retrace for a transposed or a
    # still-uniform field)
    natives, shapes, specs = disassemble_tensors(values, expand=True)
    traced = [_as_traced(n) for n in natives]
    converted = any(t is not n for t, n in zip(traced, natives))
    tensors.extend(n for n in traced if isinstance(n, torch.Tensor))
    return PhiKey(tree, tuple(shapes), tuple(specs), traced, converted)


def _traced_attributes(obj: Any) -> tuple[str, ...]:
    """The attributes of a PhiML value whose tensors are traced inputs: PhiML's variable
    attributes and, for a dataclass (a ``Field``), any other attribute holding torch tensors.

    Torch tensors are data a program computed: a point cloud advected by a step comes back as
    a ``Field`` whose geometry (the points' locations) is not a variable attribute, and as a
    constant of the key it differed on every call (a retrace per step, PhiML's own jit too).
    Constants built from Python or numpy values (a grid's bounds) stay in the key."""
    from phiml.math._tree import variable_attributes

    names: tuple[str, ...] = variable_attributes(obj)
    if not isinstance(obj, type) and hasattr(obj, "__dataclass_fields__"):
        extra = tuple(
            name for name in _all_attributes(obj)
            if name not in names and _holds_torch(getattr(obj, name, None))
        )  # fmt: skip
        if extra:
            return (*names, *extra)
    return names


_ALL_ATTRIBUTES: dict[type, tuple[str, ...]] = {}
_BY_INSTANCE = ("__all_attrs__", "__variable_attrs__", "__value_attrs__")


def _all_attributes(obj: Any) -> tuple[str, ...]:
    """PhiML's ``all_attributes``, kept per class where the class decides them (its data
    fields) rather than each instance."""
    from phiml.math._tree import all_attributes

    cls = type(obj)
    names = _ALL_ATTRIBUTES.get(cls)
    if names is None:
        names = tuple(all_attributes(obj))
        if not any(hasattr(cls, method) for method in _BY_INSTANCE):
            _ALL_ATTRIBUTES[cls] = names
    return names


class _ByIdentity:
    """Values kept for objects while those objects live (weak references, by identity):
    PhiML values are immutable. Objects that cannot be weakly referenced are not kept."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[Any], Any]] = {}

    def get(self, obj: Any) -> Any:
        """What :meth:`put` kept for ``obj`` (None: nothing)."""
        entry = self._entries.get(id(obj))
        return entry[1] if entry is not None and entry[0]() is obj else None

    def put(self, obj: Any, value: Any) -> None:
        ident = id(obj)
        try:
            ref = weakref.ref(obj, lambda dead: self._forget(ident, dead))
        except TypeError:
            return
        self._entries[ident] = (ref, value)

    def _forget(self, ident: int, dead: weakref.ref[Any]) -> None:
        entry = self._entries.get(ident)
        if entry is not None and entry[0] is dead:
            del self._entries[ident]


_HELD = _ByIdentity()
"""Answers of :func:`_holds_torch`: a grid's geometry is the same object from step to step
(the walk costs ~0.1 ms a field)."""


def _holds_torch(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return False
    held: bool | None = _HELD.get(value)
    if held is None:
        held = _walk_holds_torch(value)
        _HELD.put(value, held)
    return held


def _walk_holds_torch(value: Any) -> bool:
    from phiml.math import Tensor
    from phiml.math._tree import all_attributes, disassemble_tree

    try:
        _, tensors = disassemble_tree(value, cache=False, attr_type=all_attributes)
    except Exception:  # not a PhiML tree: nothing PhiML would trace
        return False
    return any(
        isinstance(native, torch.Tensor)
        for tensor in tensors if isinstance(tensor, Tensor)
        for native in tensor._natives()
    )  # fmt: skip


def _as_traced(native: Any) -> Any:
    """Floating-point numpy and Python natives as torch tensors (traced inputs, as PhiML's own
    jit converts them): a rotating obstacle's rotation or a moved geometry's center must not be
    a constant of the key, or every new value would retrace. Integer and boolean natives
    (counts, indices, masks) stay constants, compared by value."""
    floating = isinstance(native, float) or (
        hasattr(native, "dtype") and not isinstance(native, torch.Tensor)
        and getattr(native.dtype, "kind", "") in "fc"
    )  # fmt: skip
    if not floating:
        return native
    from phiml.backend.torch import TORCH

    return TORCH.as_tensor(native)


def assemble(key: PhiKey, tensors: Iterator[torch.Tensor]) -> Any:
    """Inverse of :func:`disassemble`: rebuild the value from new torch tensors.

    Dataclasses whose ``__post_init__`` only checks shapes (PhiFlow's ``Field``) are built
    without running the check: the structure and shapes are the ones checked when the program
    was traced, and the check costs more than the compiled step (NOTE [PhiML bridge]).
    """
    from phiml.math._tensors import assemble_tensors

    natives = [next(tensors) if slot is None else slot for slot in key.slots]
    if key.assembler is not None:
        values = key.assembler(list(natives))  # it takes them off the list it is given
    else:
        values = assemble_tensors(list(natives), key.specs)
        key.assembler = _assembler(key.specs, values)
    obj = _assemble(key.tree, values)
    _ASSEMBLED.put(obj, (key, tuple(n for n, slot in zip(natives, key.slots) if slot is None)))
    return obj


def _assembler(specs: tuple[Any, ...], made: list[Any]) -> Callable[[list[Any]], list[Any]]:
    """PhiML's ``assemble_tensors`` for ``specs``, with the fields of each top-level stack
    (a staggered grid's components: ``TensorStack``) taken from ``made``, PhiML's own result
    for this key. PhiML computes them anew from the components' shapes (merged, stacked:
    about 0.2 ms a stack, a sixth of a compiled Karman step), and they depend on the spec
    only: the shapes, the stack dimension, the natives' backend, all fixed by the key."""
    from phiml.math._tensors import TensorStack

    builders: list[Callable[[list[Any]], Any]] = []
    for spec, value in zip(specs, made):
        if spec["type"] is TensorStack and type(value) is TensorStack:
            fields = {k: v for k, v in vars(value).items() if k != "_tensors"}
            builders.append(functools.partial(_stack, spec["tensors"], fields))
        else:
            builders.append(functools.partial(spec["type"]._from_spec_and_natives, spec))

    def assembled(natives: list[Any]) -> list[Any]:
        return [build(natives) for build in builders]  # each takes its natives off the list

    return assembled


def _stack(inner: tuple[Any, ...], fields: dict[str, Any], natives: list[Any]) -> Any:
    from phiml.math._tensors import TensorStack

    stack = TensorStack.__new__(TensorStack)
    vars(stack).update(fields)
    stack._tensors = tuple(t["type"]._from_spec_and_natives(t, natives) for t in inner)
    return stack


_ASSEMBLED = _ByIdentity()
"""Values :func:`assemble` built, with their key and torch tensors, while they live. Taking a
staggered grid apart costs about 1 ms (PhiML stacks its components' shapes), more than many
compiled steps; a rollout passes each step's outputs to the next step."""


def _remembered(obj: Any) -> tuple[PhiKey, tuple[torch.Tensor, ...]] | None:
    """The key and tensors of a value :func:`assemble` built, if its tensors still have the
    shape, dtype, device and requires_grad the key says (``requires_grad_()`` may change)."""
    entry = _ASSEMBLED.get(obj)
    if entry is None:
        return None
    key, natives = entry
    metas = tuple((tuple(n.shape), n.dtype, n.device, n.requires_grad) for n in natives)
    return (key, natives) if metas == key.metas else None


def _assemble(node: Any, values: list[Any]) -> Any:
    from phiml.math._tree import DataclassTreeNode, assemble_tree

    if isinstance(node, tuple):
        return tuple(_assemble(item, values) for item in node)
    if isinstance(node, list):
        return [_assemble(item, values) for item in node]
    if type(node) is dict and "__layout__" not in node:
        return {name: _assemble(item, values) for name, item in node.items()}
    if isinstance(node, DataclassTreeNode) and _checks_only(node.cls):
        instance = node.cls.__new__(node.cls)
        for name, item in node.extracted.items():
            object.__setattr__(instance, name, _assemble(item, values))
        for name, value in node.not_extracted.items():
            object.__setattr__(instance, name, value)
        instance.__dict__.update(node.cache or {})
        return instance
    return assemble_tree(node, values)  # takes its tensors from the front of ``values``


_CHECK_ONLY = {"phi.field._field.Field": frozenset(
    {"math", "merge_shapes", "values", "non_batch", "sampled_elements", "non_channel"}
)}  # fmt: skip
"""Classes whose ``__post_init__`` is a shape check, with the names that check may read: if a
PhiFlow version reads anything else there, its ``__post_init__`` runs as usual."""


def _checks_only(cls: type) -> bool:
    return _post_init_checks_only(cls, getattr(cls, "__post_init__", None))


@functools.lru_cache(maxsize=64)
def _post_init_checks_only(cls: type, post_init: Any) -> bool:
    """Read once per class and ``__post_init__`` (a replaced one is read again)."""
    known = _CHECK_ONLY.get(f"{cls.__module__}.{cls.__qualname__}")
    code = getattr(post_init, "__code__", None)
    return (
        known is not None
        and code is not None
        and not code.co_freevars
        and set(code.co_names) <= known
    )
