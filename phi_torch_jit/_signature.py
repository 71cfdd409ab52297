"""Stage 0: arguments -> (cache key, tensor leaves), and back.

One recursive pass turns a call's ``(args, kwargs)`` into

* the list of tensor leaves, which become the traced inputs, and
* a hashable *spec*: a nested tuple that describes the structure, the static (non-tensor)
  leaves by value, and each tensor leaf by shape, dtype, device and requires_grad. The spec
  is the cache key; ``unflatten`` rebuilds the arguments from it and new tensors.

Spec nodes are plain tuples whose first item is a tag (fast to hash and compare):

=====  ===================================================  ==================
tag    node                                                 meaning
=====  ===================================================  ==================
``T``  ``("T", shape, dtype, device, requires_grad,        tensor leaf (arguments';
       strides, type, is_inference, is_leaf, conj and       an output's: ``("T",)``)
       neg bits of a complex one, its Python attributes)``
``S``  ``("S", type, value[, attributes])``                 static leaf (a callable object:
                                                              with its plain attributes)
``M``  ``("M", module)``                                    nn.Module (identity)
``Q``  ``("Q", list | tuple, children)``                    sequence (a frozenset of objects too)
``N``  ``("N", namedtuple class, children)``                namedtuple
``D``  ``("D", dict type, keys, key forms, children)``      dict (the forms, None where every key
                                                              is a str: each key's ``S`` node)
``C``  ``("C", dataclass, field names, children)``          dataclass, or a namespace
                                                              (``NAMESPACES``) by its attributes
``X``  ``("X", ValueType, key, n_tensors)``               a registered library's value
                                                              (``extend.register_values``)
=====  ===================================================  ==================

Static leaves are ``None``, bool, int, float, complex, str, bytes, enums, torch
dtypes/devices/layouts/sizes, and any other hashable value: objects with a value ``__hash__``
are keyed by value, callables by identity. Anything else (unhashable values, plain objects hashed
by identity) is rejected with the path where it sits: keyed by identity, its mutations would
be silently ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import decimal
import enum
import math
import numbers
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ._callable_state import (
    NOT_STATEFUL,
    PRIMITIVES,
    TensorAttributes,
    enum_key,
    holds_objects,
    left_to_guards,
    plain_attributes,
)
from .errors import OutputError, SignatureError
from .extend import value_type_of

__all__ = ["Spec", "flatten_arguments", "unflatten_arguments", "flatten_outputs", "unflatten",
           "modules_in", "callables_in", "classes_in", "merge_traced_numbers",
           "count_program_outputs"]  # fmt: skip

NAMESPACES: tuple[type, ...] = (types.SimpleNamespace, argparse.Namespace)
"""Attribute bags users keep configuration in (``parser.parse_args()``); as arguments they
are flattened by attribute, like dataclasses."""

Spec = tuple[Any, ...]


class _Unsupported(Exception):
    """Internal: a leaf that cannot be flattened; collects its path while unwinding."""

    def __init__(self, value: Any, reason: str) -> None:
        super().__init__(reason)
        self.value = value
        self.reason = reason
        self.path: list[str] = []

    def where(self, root: str) -> str:
        return root + "".join(reversed(self.path))


def _static_leaf(obj: Any) -> Spec:
    cls = type(obj)
    if cls in PRIMITIVES:
        return _primitive(obj, cls)
    if isinstance(obj, enum.Enum):  # the member, and the attributes it holds (``.factor``)
        return ("S", cls, obj, enum_key(obj))
    if cls.__hash__ is None:
        raise _Unsupported(obj, f"unhashable static value of type {cls.__qualname__}")
    hash_impl: object = cls.__hash__
    if hash_impl is object.__hash__ and not callable(obj):
        if left_to_guards(obj):
            return ("S", cls, obj)
        raise _Unsupported(
            obj,
            f"object of type {cls.__qualname__} has no value-based hash, so a change to it "
            "could not be noticed",
        )
    if cls is frozenset:  # equal sets may iterate in other orders (a loop over the keys)
        return ("S", cls, obj, tuple(map(repr, obj)) if len(obj) <= 256 else ())
    if (exact := _exact(obj)) is not None:  # np.float64(-0.0), Decimal("-0"), range(0, 3, 2)
        return ("S", cls, obj, exact)
    if not isinstance(obj, NOT_STATEFUL):
        # a callable object (``forcing(x)`` with ``forcing.amp``): identity and its plain
        # attributes, so that ``forcing.amp = 5.0`` retraces; an object of yours with an
        # ``__eq__`` of its own: equal, and its attributes too (its ``__eq__`` may compare
        # fewer than the step reads)
        return ("S", cls, obj, plain_attributes(obj))
    return ("S", cls, obj)


_NEGATIVE_ZERO = (("sign", -1.0),)
"""The key of ``-0.0`` differs from ``0.0``'s (they compare equal and hash alike)."""


def _exact(obj: Any) -> tuple[tuple[str, Any], ...] | None:
    """What ``==`` does not tell apart in a value keyed by value, where a program reading it
    may differ (probe 43c): a zero's sign (``-0.0``, a NumPy float, a complex number's zero
    parts), a Decimal's sign, digits and exponent (``Decimal("-0")``, ``Decimal("1.0")``), a
    range's start, stop and step (``range(0, 4, 2) == range(0, 3, 2)``); None: nothing."""
    if isinstance(obj, decimal.Decimal):
        return (("digits", obj.as_tuple()),)
    if isinstance(obj, range):
        return (("range", (obj.start, obj.stop, obj.step)),)
    if isinstance(obj, (numbers.Integral, enum.Enum)) or not isinstance(obj, numbers.Complex):
        return None
    parts = (obj,) if isinstance(obj, numbers.Real) else (obj.real, obj.imag)
    signs = tuple(math.copysign(1.0, float(p)) if p == 0 else 0.0 for p in parts)
    if -1.0 not in signs:
        return None
    return _NEGATIVE_ZERO if len(signs) == 1 else (("sign", signs),)


def _primitive(obj: Any, cls: type) -> Spec:
    if (cls is float and obj == 0.0) or cls is complex:  # -0.0 == 0.0, but 1 / -0.0 is -inf
        if (exact := _exact(obj)) is not None:
            return ("S", cls, obj, exact)
    return ("S", cls, obj)


def _flatten(obj: Any, tensors: list[torch.Tensor], meta: bool) -> Spec:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        if meta:  # strides: traced Python may read them (stride(), is_contiguous()); so
            own = obj.__dict__  # may it read is_leaf, a complex view's bits, x.scale
            bits = (obj.is_conj(), obj.is_neg()) if obj.is_complex() else None
            return ("T", tuple(obj.shape), obj.dtype, obj.device, obj.requires_grad,
                    obj.stride(), type(obj), obj.is_inference(), obj.is_leaf, bits,
                    TensorAttributes(own) if own else None)  # fmt: skip
        return ("T",)
    cls = type(obj)
    if cls is tuple or cls is list:
        return ("Q", cls, _flatten_items(obj, tensors, meta, None))
    if cls in PRIMITIVES:
        return _primitive(obj, cls)
    value_type = value_type_of(obj)
    if value_type is not None:
        start = len(tensors)
        key = value_type.flatten(obj, tensors)
        return ("X", value_type, key, len(tensors) - start)
    if isinstance(obj, dict):
        keys = tuple(obj)
        for key in keys:
            if type(key) not in PRIMITIVES and not isinstance(key, enum.Enum):
                raise _Unsupported(key, f"dict key of type {type(key).__qualname__}")
        forms = None if all(type(k) is str for k in keys) else tuple(map(_static_leaf, keys))
        return ("D", cls, keys, forms, _flatten_items(obj.values(), tensors, meta, keys))
    if isinstance(obj, tuple) and hasattr(cls, "_fields"):
        return ("N", cls, _flatten_items(obj, tensors, meta, cls._fields, attr=True))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = tuple(f.name for f in dataclasses.fields(obj))
        values = [getattr(obj, n) for n in names]
        return ("C", cls, names, _flatten_items(values, tensors, meta, names, attr=True))
    if cls in NAMESPACES:  # keyed by their attributes, like dataclasses
        names = tuple(vars(obj))
        values = list(vars(obj).values())
        return ("C", cls, names, _flatten_items(values, tensors, meta, names, attr=True))
    if isinstance(obj, nn.Module):
        return ("M", obj)
    if cls is torch.Size:  # x.shape passed on (probe 36c): ints, keyed by value
        return ("S", cls, obj)
    if cls is frozenset and not all(type(m) in PRIMITIVES for m in obj):  # objects in it:
        return ("Q", cls, _flatten_items(obj, tensors, meta, None))  # each as in a tuple (39b)
    if isinstance(obj, (tuple, list)):
        raise _Unsupported(obj, f"subclass {cls.__qualname__} of {cls.__mro__[1].__name__}")
    return _static_leaf(obj)


def _flatten_items(
    items: Any,
    tensors: list[torch.Tensor],
    meta: bool,
    names: Sequence[Any] | None,
    attr: bool = False,
) -> tuple[Spec, ...]:
    children = []
    for i, item in enumerate(items):
        try:
            children.append(_flatten(item, tensors, meta))
        except _Unsupported as error:
            label = i if names is None else names[i]
            error.path.append(f".{label}" if attr else f"[{label!r}]")
            raise
    return tuple(children)


def flatten_arguments(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    owner: str,
    arg_names: Sequence[str] = (),
    in_order: bool = False,
) -> tuple[Spec, list[torch.Tensor]]:
    """Flatten a call's arguments into (cache key, tensor leaves).

    Keyword arguments are keyed in name order, so ``f(a=1, b=2)`` and
    ``f(b=2, a=1)`` share a specialization; in the call's order with ``in_order`` (a
    function taking ``**kwargs`` may loop over them: ``_options.keywords_in_order``).

    Raises:
        SignatureError: a leaf is neither a tensor, a supported container nor a
            hashable static value; the message names the argument path.
    """
    tensors: list[torch.Tensor] = []
    names = tuple(kwargs) if in_order else tuple(sorted(kwargs))
    try:
        pos = _flatten_items(args, tensors, True, None)
    except _Unsupported as error:
        index = int(error.path.pop()[1:-1])
        root = arg_names[index] if index < len(arg_names) else f"args[{index}]"
        raise _signature_error(error, root, owner) from None
    try:
        kw = _flatten_items([kwargs[n] for n in names], tensors, True, names)
    except _Unsupported as error:
        root = error.path.pop()[2:-2]
        raise _signature_error(error, root, owner) from None
    return ("A", pos, names, kw), tensors


def _signature_error(error: _Unsupported, root: str, owner: str) -> SignatureError:
    return SignatureError(
        f"phi_torch_jit: argument `{error.where(root)}` of {owner} is not supported: "
        f"{error.reason}. Pass tensors, tuples/lists/dicts/namedtuples/dataclasses of "
        "tensors, nn.Modules, or hashable static values (int, float, bool, str, None, enums, "
        "tuples of these); convert other values to tensors or make them hashable."
    )


def unflatten_arguments(
    spec: Spec, tensors: Sequence[torch.Tensor]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Inverse of :func:`flatten_arguments`: rebuild ``(args, kwargs)``."""
    it = iter(tensors)
    _, pos, names, kw = spec
    args = tuple(unflatten(child, it) for child in pos)
    kwargs = {name: unflatten(child, it) for name, child in zip(names, kw)}
    return args, kwargs


def flatten_outputs(value: Any, owner: str) -> tuple[Spec, list[torch.Tensor]]:
    """Flatten a function's return value into (structure spec, tensor leaves).

    Tensor leaves carry no metadata in the spec; non-tensor leaves are static
    and are returned by later calls exactly as recorded.

    Raises:
        OutputError: a leaf cannot be returned from a compiled program.
    """
    tensors: list[torch.Tensor] = []
    try:
        return _flatten(value, tensors, False), tensors
    except _Unsupported as error:
        raise OutputError(
            f"phi_torch_jit: the output `{error.where('output')}` of {owner} is not supported: "
            f"{error.reason}. Return tensors, containers of tensors, or hashable static values; "
            "convert other values to tensors."
        ) from None


def unflatten(spec: Spec, tensors: Iterator[torch.Tensor]) -> Any:
    """Rebuild one value from its spec, taking tensor leaves from ``tensors`` in order."""
    tag = spec[0]
    if tag == "T":
        tensor = next(tensors)
        if len(spec) > 10 and spec[10] is not None:  # the trace's tensor: the caller's
            spec[10].set_on(tensor)  # attributes (x.scale), which the key holds
        return tensor
    if tag == "S":
        return spec[2]
    if tag == "I":  # a Python number the program computes (a traced size, a count)
        return spec[1](next(tensors))
    if tag == "Q":
        return spec[1](unflatten(c, tensors) for c in spec[2])
    if tag == "D":
        return spec[1](zip(spec[2], [unflatten(c, tensors) for c in spec[4]]))
    if tag == "N":
        return spec[1](*[unflatten(c, tensors) for c in spec[2]])
    if tag == "C":
        obj = spec[1]() if spec[1] in NAMESPACES else object.__new__(spec[1])
        for name, child in zip(spec[2], spec[3]):
            object.__setattr__(obj, name, unflatten(child, tensors))
        return obj
    if tag == "M":
        return spec[1]
    if tag == "X":
        return spec[1].unflatten(spec[2], tensors)
    raise AssertionError(f"unknown spec tag {tag!r}")


_NUMBERS = (int, float, bool)


def merge_traced_numbers(recorded: Spec, traced: Spec) -> Spec | None:
    """The output spec of a compiled program, or None if the two passes' structures differ.

    A Python number the record pass returned (``("S", int, 3)``) that the trace returned as a
    tensor (TorchScript traces sizes such as ``x.nonzero().shape[0]`` as tensors) becomes a
    leaf ``("I", int)``: computed by the program on every call, converted back to the number.
    """
    if recorded == traced:
        return recorded
    if recorded[0] == "S" and recorded[1] in _NUMBERS and traced == ("T",):
        return ("I", recorded[1])
    if (
        recorded[0] != traced[0]
        or recorded[0] not in ("Q", "N", "D", "C")
        or len(recorded) != len(traced)
    ):
        return None
    if recorded[:-1] != traced[:-1] or len(recorded[-1]) != len(traced[-1]):
        return None
    children = [merge_traced_numbers(a, b) for a, b in zip(recorded[-1], traced[-1])]
    if any(c is None for c in children):
        return None
    return (*recorded[:-1], tuple(children))


def count_program_outputs(spec: Spec) -> int:
    """How many tensors a program returns for an output spec (tensor and number leaves)."""
    if spec[0] in ("T", "I"):
        return 1
    if spec[0] == "X":  # a registered library's value: its torch tensors
        return int(spec[3])
    if spec[0] in ("Q", "N", "D", "C"):
        return sum(count_program_outputs(c) for c in spec[-1])
    return 0


def _nodes(spec: Spec, tag: str, at: int = 1) -> list[Any]:
    """The payloads (entry ``at``) of the ``tag`` nodes of ``spec``, in argument order."""
    found: list[Any] = []
    stack = [spec]
    while stack:
        node = stack.pop()
        if node[0] == tag:
            found.append(node[at])
        elif node[0] in ("Q", "N", "D", "C", "A"):
            children = node[-1] if node[0] != "A" else node[1] + node[3]
            stack.extend(reversed(children))
    return found


def modules_in(spec: Spec) -> list[nn.Module]:
    """The nn.Modules passed as arguments, in argument order."""
    return _nodes(spec, "M")


def callables_in(spec: Spec) -> list[Any]:
    """The callable static arguments keyed by identity (functions, callable objects, bound
    methods, partials; not builtins or classes), modules, iterators, and objects of yours
    keyed by value that hold other objects (:func:`holds_objects`), in argument order:
    the Python guards walk the code they run and the state they hold (a module's data; an
    iterator makes the call run eagerly)."""
    found = [
        value for value in _nodes(spec, "S", at=2)
        if (callable(value) and not isinstance(value, _BY_CODE)
            and type(value) not in PRIMITIVES) or left_to_guards(value) or holds_objects(value)
    ]  # fmt: skip
    return found + _held_by_tensors(spec)


def _held_by_tensors(spec: Spec) -> list[Any]:
    """The objects set on tensor arguments that their key holds by identity (``x.cfg = ns``,
    ``x.op = fn``): what the step reads of them is guarded, rooted at them (probe 46a:
    ``x.cfg.k`` changed in place, or a global the function ``x.op`` reads, was stale)."""
    found = []
    for attributes in _nodes(spec, "T", at=-1):  # (a tensor keyed without metadata: "T")
        if isinstance(attributes, TensorAttributes):
            found += [attributes.values[name] for name, key in attributes.key
                      if type(key) is tuple and key[0] == "object"]  # fmt: skip
    return found


def classes_in(spec: Spec) -> list[type]:
    """The classes of static values (an enum member, a frozen dataclass), namedtuples and
    dataclasses passed, and classes passed themselves: what their methods read is walked."""
    found = [v if isinstance(v, type) else type(v) for v in _nodes(spec, "S", at=2)]
    found += [*_nodes(spec, "N"), *_nodes(spec, "C")]
    return list({id(k): k for k in found if k not in PRIMITIVES}.values())


_BY_CODE = (types.BuiltinFunctionType, types.BuiltinMethodType, type)
"""Callables the guards do not walk (builtins: no Python code; classes: constructed)."""


def converts_natives(spec: Spec) -> bool:
    """Whether a registered library's value had other data made torch tensors (PhiML's float
    natives of another backend): the record pass must then see the converted values, as the
    trace does."""
    return any(getattr(key, "converted", False) for key in _nodes(spec, "X", at=2))
