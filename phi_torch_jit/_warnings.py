"""Helpers for warnings caught with ``warnings.catch_warnings(record=True)``."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

__all__ = ["reemit", "describe_warning"]


def reemit(caught: Sequence[warnings.WarningMessage]) -> None:
    """Warn again, at the original location, what a ``catch_warnings(record=True)`` caught."""
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def describe_warning(w: warnings.WarningMessage) -> str:
    first = str(w.message).splitlines()[0].split(". ")[0].rstrip(".")
    return f"{first} ({w.filename}:{w.lineno})"
