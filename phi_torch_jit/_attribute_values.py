"""Stage 5: how the module guard compares the attributes it reads (``self.k``, a class's
``SCALE``, a module's registries) where they are not the same objects (the guard's own, hot,
check): values of the same types and bits."""

from __future__ import annotations

from typing import Any

from ._reads._records import canonical

__all__ = ["GONE", "changed", "strictly_same"]

GONE = object()
"""An attribute deleted since the trace."""


def changed(old: Any, value: Any) -> bool:
    return not strictly_same(value, old)


def strictly_same(now: Any, was: Any) -> bool:
    """Same types and the same bits, nested ones included (``canonical``)."""
    if now is was:
        return True
    if isinstance(was, dict):  # a module's registry or hooks: only itself (equal ones differ)
        return False
    if type(now) is tuple and type(was) is tuple and len(now) == len(was):
        return all(map(strictly_same, now, was))  # one module's attributes, read together
    try:
        return type(now) is type(was) and canonical(now)[1] == canonical(was)[1]
    except Exception:  # a value that cannot be written or compared: a change
        return False
