"""Stage 1 (reads): what ``isinstance``/``issubclass`` answered against abstract base classes.

The record pass notes each (ABC, class) pair tested (:mod:`.._type_tests`); the guard asks
``issubclass`` again for each at every call (an ABC's cache answers in about 0.1 us) and
compares the answers: ``ABC.register(C)`` between calls retraces where it changes one of them,
and only there. Where a test's answer was not the ABC machinery's alone, the token every
registration changes (``abc.get_cache_token()``) is guarded as well (probe 41a's guard).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from .._type_tests import ANY_REGISTRATION
from ._environment import ABC_TOKEN
from ._records import Source, Step

__all__ = ["type_test_sources"]


class _Answers:
    """The pairs a record pass tested, answered now."""

    def __init__(self, pairs: list[tuple[type, type]]) -> None:
        self.pairs = pairs

    def read(self) -> tuple[bool, ...]:
        return tuple(issubclass(klass, cls) for cls, klass in self.pairs)

    def __repr__(self) -> str:
        return f"<the answers of {len(self.pairs)} isinstance/issubclass tests>"


def type_test_sources(tests: Mapping[tuple[type, type], bool]) -> Iterator[tuple[Any, Source]]:
    """(key, source) of the answers of ``tests`` (pair -> answer in the record pass), and of
    the registration token where one of them needs it."""
    pairs = [pair for pair in tests if pair != ANY_REGISTRATION]
    if pairs:
        names = ", ".join(f"{k.__name__} in {c.__name__}" for c, k in pairs[:3])
        label = f"isinstance/issubclass answers ({names}{', ...' if len(pairs) > 3 else ''})"
        yield ("type tests",), Source(label, "abc", holder=_Answers(pairs),
                                      path=(Step(True, "read", call=True),))  # fmt: skip
    if ANY_REGISTRATION in tests:
        yield ("abc",), ABC_TOKEN
