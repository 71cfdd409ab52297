"""The registered libraries' hooks (:mod:`.extend`) as the stages ask them: all at once.

Each function combines what every registered :class:`~.extend.Library` answers; with no library
registered each is a cheap no-op. Nothing here knows a library by name.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch

from .extend import ClosureRoot, DeferredChecks, LoopSolvers, PassHooks, libraries

__all__ = [
    "LibraryPasses",
    "ForwardChecks",
    "forward_checks",
    "custom_forward",
    "closure_roots",
    "backward_scope",
    "owned_by_library",
    "library_solvers",
    "harmless_tracer_warning",
    "reads_input_shape",
]


class LibraryPasses:
    """Every library's :class:`~.extend.PassHooks` for one specialization (record and trace)."""

    def __init__(self) -> None:
        made = (library.pass_hooks() for library in libraries())
        self.hooks: tuple[PassHooks, ...] = tuple(h for h in made if h is not None)

    @property
    def used(self) -> bool:
        """Whether a library took part in the record pass."""
        return any(h.used for h in self.hooks)

    def active(self, recording: bool = False) -> AbstractContextManager[list[Any]]:
        """Every library's hooks entered around a record (``recording``) or trace pass."""
        return _all_entered(hooks.active(recording) for hooks in self.hooks)

    def outside_user_call(self) -> AbstractContextManager[list[Any]]:
        """Libraries set their call records aside while the program runs for us."""
        return _all_entered(hooks.outside_user_call() for hooks in self.hooks)


class ForwardChecks:
    """The checks every library deferred while one custom forward was traced: their tensors
    follow the forward's outputs, library after library."""

    def __init__(self, parts: Sequence[DeferredChecks] = ()) -> None:
        self.parts = tuple(p for p in parts if p)
        self.tensors: list[torch.Tensor] = [t for p in self.parts for t in p.tensors]

    def __bool__(self) -> bool:
        return bool(self.parts)

    def _split(self, values: Sequence[torch.Tensor]) -> Iterator[tuple[DeferredChecks, Any]]:
        start = 0
        for part in self.parts:
            yield part, values[start : start + len(part.tensors)]
            start += len(part.tensors)

    def run(self, values: Sequence[torch.Tensor]) -> None:
        """After a compiled call: each library's checks with their values."""
        for part, own in self._split(values):
            part.run(own)

    def traced(self, values: Sequence[torch.Tensor]) -> None:
        """In the trace pass: each library notes the call around its traced values."""
        for part, own in self._split(values):
            part.traced(own)


class _Collecting:
    """What :func:`forward_checks` yields: the libraries' collectors, read when it exits."""

    def __init__(self) -> None:
        self.collected: list[DeferredChecks] = []
        self.checks = ForwardChecks()


@contextmanager
def forward_checks(always: bool = False) -> Iterator[_Collecting]:
    """Collect every library's deferred checks while a custom forward runs; ``.checks`` holds
    them once the block is left."""
    collecting = _Collecting()
    with _all_entered(lib.forward_checks(always) for lib in libraries()) as collecting.collected:
        yield collecting
    collecting.checks = ForwardChecks(collecting.collected)


def custom_forward(cls: type) -> Callable[..., Any] | None:
    """The forward a library gives the Function class ``cls`` in place of its own, or None."""
    for library in libraries():
        forward = library.custom_forward(cls)
        if forward is not None:
            return forward
    return None


def closure_roots(cls: type) -> tuple[ClosureRoot, ...]:
    """Where the libraries say the call's own values sit in ``cls``'s closures."""
    return tuple(root for library in libraries() for root in library.closure_roots(cls))


def backward_scope(cls: type) -> AbstractContextManager[list[Any]]:
    """The contexts libraries want the backward of ``cls`` to run in."""
    return _all_entered(lib.backward_scope(cls) for lib in libraries())


@contextmanager
def _all_entered(managers: Iterable[AbstractContextManager[Any] | None]) -> Iterator[list[Any]]:
    """Enter each of ``managers`` that is not None, in order; yields what they returned."""
    with ExitStack() as stack:
        yield [stack.enter_context(m) for m in managers if m is not None]


def owned_by_library(source: Any) -> bool:
    """Whether ``source`` is a registered library's code (:meth:`~.extend.Library.owns_code`)."""
    return source is not None and any(lib.owns_code(source) for lib in libraries())


def library_solvers(
    source: Any, capture: Callable[[Callable[..., Any], str], Any], cache: dict[Any, Any]
) -> LoopSolvers | None:
    """The captured solvers of the library owning ``source``, made once per library in
    ``cache`` (one per engine: the blocks are compiled by its backend), or None."""
    for library in libraries():
        if library.owns_code(source):
            if library not in cache:
                cache[library] = library.loop_solvers(capture)
            solvers: LoopSolvers | None = cache[library]
            if solvers is not None:
                return solvers
    return None


def harmless_tracer_warning(warning: warnings.WarningMessage) -> bool:
    return any(lib.harmless_tracer_warning(warning) for lib in libraries())


def reads_input_shape(warning: warnings.WarningMessage) -> bool:
    return any(lib.reads_input_shape(warning) for lib in libraries())


def configuration_classes() -> tuple[type, ...]:
    """The registered libraries' classes of settings objects
    (:meth:`~.extend.Library.configuration_classes`)."""
    return tuple(cls for lib in libraries() for cls in lib.configuration_classes())
