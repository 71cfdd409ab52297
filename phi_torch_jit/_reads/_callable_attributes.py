"""Stage 1 (reads): attributes set on Python's callable objects that are not functions, and
the objects of yours that C callables hold without showing them.

A ``functools.partial``, a ``partialmethod``, a ``staticmethod`` or ``classmethod`` object, a
``cached_property`` and an ``lru_cache`` wrapper each have a ``__dict__`` of their own, where
code keeps settings (``P.scale = 2.0``), objects (``P.cfg``) and functions (``P.post``). The
walk read only the paths code spells: ``getattr(P, "scale", 1.0)``, ``hasattr(P, "flag")`` or
``c = P.cfg; c.k`` were silently wrong (probe 49). Their attributes are now fields like an
object's of yours: how many there are (one added or deleted later), and each one walked.
"""

from __future__ import annotations

import functools
import gc
import types
from typing import Any

from ._code_walk import user_class
from ._records import LENGTH, PYTHONS_OWN, Step, probe

__all__ = ["WRAPPERS", "attribute_paths", "attribute_values", "opaque_held"]

WRAPPERS: tuple[type, ...] = (
    functools.partial,
    functools.partialmethod,
    staticmethod,
    classmethod,
    functools.cached_property,
    type(functools.lru_cache(maxsize=None)(len)),
)
"""Python's callable objects whose ``__dict__`` holds what code sets on them."""

_MAX_ATTRIBUTES = 512
"""Attributes of one such object that are guarded (as for a function's)."""

_OWN_DICT = Step(True, "__dict__")


def _names(value: Any) -> list[str]:
    own = probe(value, "__dict__")
    if type(own) is not dict:
        return []
    return [n for n in own if isinstance(n, str) and n.isidentifier() and n not in PYTHONS_OWN
            and not (n.startswith("__") and n.endswith("__"))][:_MAX_ATTRIBUTES]  # fmt: skip


def attribute_paths(value: Any) -> list[Step | tuple[Step, ...]]:
    """Paths to how many attributes ``value`` has and to each (``__wrapped__`` and Python's
    own names are not the user's: a wrapper's function is walked as code)."""
    return [(_OWN_DICT, LENGTH), *(Step(True, n) for n in _names(value))]


def attribute_values(value: Any) -> list[Any]:
    """What the first 64 attributes hold, for the walk of code (``P.post = post``)."""
    own = probe(value, "__dict__")
    return [own[n] for n in _names(value)[:64]] if type(own) is dict else []


_OPAQUE = frozenset(("functools", "numpy"))


def opaque_held(value: Any) -> list[Any]:
    """The bound methods and objects of yours that a C callable of ``functools`` or NumPy
    holds and shows no attribute for (``functools.cmp_to_key(order.cmp)``,
    ``numpy.frompyfunc(scale, 1, 1)``), as the garbage collector sees them: what their state
    is (``order.rev``) is walked from them (probe 53a). They cannot be swapped while the
    callable is the same object, which is guarded by identity."""
    if type(value).__module__ not in _OPAQUE or isinstance(value, (type, *WRAPPERS)):
        return []
    try:
        held = gc.get_referents(value)
    except Exception:  # a C type's own traversal rules
        return []
    return [h for h in held if isinstance(h, types.MethodType)
            or (not isinstance(h, type) and user_class(type(h)))]  # fmt: skip
