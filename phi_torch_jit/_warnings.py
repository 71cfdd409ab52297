"""Warnings: re-emitting caught ones, describing them, and torch's TorchScript notices.

torch deprecates TorchScript (``torch.jit.trace`` / ``script`` warn since 2.13, with a
FutureWarning since 2.15), and PhiML calls ``torch.jit.script`` inside its own functions.
While phi_torch_jit records, traces or compiles a function, those notices are about
machinery the user did not choose (engine "compile" runs no TorchScript of its own; PhiML's
calls happen wherever PhiML is used), so :func:`torchscript_notices_hidden` hides them for
the duration of the pass. Every other warning passes. See NOTE [TorchScript notices].
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from ._compat import TORCHSCRIPT_NOTICE
from ._patches import RefCounted

__all__ = [
    "TORCHSCRIPT_NOTICE",
    "reemit",
    "describe_warning",
    "is_torchscript_notice",
    "torchscript_notices_hidden",
]

_NOTICE = re.compile(TORCHSCRIPT_NOTICE)


def reemit(caught: Sequence[warnings.WarningMessage]) -> None:
    """Warn again, at the original location, what a ``catch_warnings(record=True)`` caught."""
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def describe_warning(w: warnings.WarningMessage) -> str:
    first = str(w.message).splitlines()[0].split(". ")[0].rstrip(".")
    return f"{first} ({w.filename}:{w.lineno})"


def is_torchscript_notice(w: warnings.WarningMessage) -> bool:
    """Whether a caught warning is torch's notice that TorchScript is deprecated."""
    return issubclass(w.category, (DeprecationWarning, FutureWarning)) and bool(
        _NOTICE.match(str(w.message))
    )


class _NoticeFilter:
    """An ``ignore`` entry at the front of ``warnings.filters`` while some pass runs."""

    def __init__(self) -> None:
        self._entry: Any = None

    def install(self) -> None:
        warnings.filterwarnings("ignore", message=TORCHSCRIPT_NOTICE, category=Warning)
        self._entry = warnings.filters[0]

    def remove(self) -> None:
        # warnings.catch_warnings in another thread may have swapped the list meanwhile;
        # then the entry is already gone from the list in force (NOTE [TorchScript notices]).
        filters: list[Any] = warnings.filters  # type: ignore[assignment]
        if self._entry in filters:
            filters.remove(self._entry)
        self._entry = None


_FILTER = _NoticeFilter()
_HIDDEN = RefCounted(_FILTER.install, _FILTER.remove)


def torchscript_notices_hidden() -> AbstractContextManager[None]:
    """Context manager: torch's TorchScript deprecation notices are ignored while it runs."""
    return _HIDDEN.active()
