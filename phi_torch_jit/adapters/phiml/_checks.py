"""PhiML's convergence checks and ``SolveTape`` records, deferred out of traced forwards.

While a custom forward is traced, PhiML's values are unavailable and ``SolveInfo``'s convergence
check would be skipped: :class:`_ConvergenceCheck` defers it to a :class:`ForwardChecks`, whose
tensors become extra outputs of the compiled forward; each compiled call then runs the check
with real values (``NotConverged``, ``Diverged`` on the same calls as eager code) and adds the
solve's ``SolveInfo`` to the open tapes (NOTE [SolveTape under jit] in docs/design.md).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from ..._patches import RefCounted
from ._backend_patches import LOOPS
from ._values import PhiKey, assemble, disassemble

__all__ = ["ForwardChecks", "deferred_checks", "Deferred", "CHECKS", "CHECKING", "OUTER_TAPES",
           "solve_infos", "open_tapes", "tapes_set_aside", "add_to_tapes"]  # fmt: skip


class ForwardChecks:
    """PhiML convergence checks met while a custom forward was traced (values unavailable).

    The tensors they need become extra outputs of the compiled forward; :meth:`run` calls the
    checks with the values of each compiled call, so ``NotConverged`` and ``Diverged`` are
    raised on the same calls as in eager code. ``always``: checks are deferred even where
    values are available (a forward run as Python around a captured loop returns them as the
    traced forward does)."""

    def __init__(self, always: bool = False) -> None:
        self.always = always
        self.checks: list[Deferred] = []
        self.tensors: list[torch.Tensor] = []

    def __bool__(self) -> bool:
        return bool(self.checks)

    def add(self, check: Deferred, tensors: list[torch.Tensor]) -> None:
        self.checks.append(check)
        self.tensors.extend(tensors)

    def run(self, tensors: Sequence[torch.Tensor]) -> None:
        """A compiled call's values: each check runs (raising as eager PhiML does), then its
        solves go to the open tapes. A check that raises leaves the tapes as they were: the
        Python function runs the call again and adds its own solves (eager's entries, raising
        or not), so a compiled solve that diverged only by rounding leaves no trace."""
        start = 0
        for check in self.checks:
            check.call(tensors[start : start + check.count])
            start += check.count
        if open_tapes():  # SolveInfo costs ~1 ms a call (PhiML formats it)
            add_to_tapes(solve_infos(self.checks, tensors, real=True))

    def traced(self, tensors: Sequence[torch.Tensor]) -> None:
        """The trace pass: SolveTapes the jitted function opened get the solve's SolveInfo
        around the traced values, so compiled calls return what each call's solve did."""
        add_to_tapes(solve_infos(self.checks, tensors, real=False), skip=OUTER_TAPES.get())


_COLLECTING: ContextVar[ForwardChecks | None] = ContextVar("phi_torch_jit_checks", default=None)


OUTER_TAPES: ContextVar[tuple[Any, ...]] = ContextVar("phi_torch_jit_outer_tapes", default=())
"""PhiML ``SolveTape``s open when the current pass began (set by the bridge): compiled calls
fill them; the trace pass fills only the tapes the jitted function opens itself."""


@contextmanager
def deferred_checks(always: bool = False) -> Iterator[ForwardChecks]:
    """Collect PhiML's convergence checks skipped under a trace while the block runs (all of
    them, values available or not, if ``always``); the open tapes are set aside meanwhile."""
    checks = ForwardChecks(always)
    if "phiml.math._optimize" not in sys.modules:
        yield checks
        return
    token = _COLLECTING.set(checks)
    try:
        with CHECKS.active(), LOOPS.active(), tapes_set_aside():
            yield checks
    finally:
        _COLLECTING.reset(token)


class _ConvergenceCheck:
    """``SolveInfo.convergence_check`` that defers itself to a collector while values are
    unavailable (a forward being traced), instead of silently skipping."""

    def __init__(self) -> None:
        self.original: Any = None

    def install(self) -> None:
        from phiml.math._optimize import SolveInfo

        original = self.original = SolveInfo.__dict__["convergence_check"]

        def convergence_check(info: Any, only_warn: bool) -> None:
            from phiml.math import all_available

            collector = _COLLECTING.get()
            if collector is None:
                token = CHECKING.set(True)  # the record pass under install(): values are real
                try:
                    formatted = _with_message(info)
                    for tape in open_tapes():  # the solve just added its raw info to them
                        tape.solves[:] = [formatted if s is info else s for s in tape.solves]
                    return original(formatted, only_warn)  # type: ignore[no-any-return]
                finally:
                    CHECKING.reset(token)
            if not collector.always and all_available(info.diverged, info.converged):
                return original(info, only_warn)  # type: ignore[no-any-return]
            parts = (info.x, info.residual, info.iterations, info.function_evaluations,
                     info.converged, info.diverged)  # fmt: skip
            natives: list[torch.Tensor] = []
            key = disassemble(parts, natives)

            def check(*values: Any) -> None:
                token = CHECKING.set(True)
                try:  # built with real values: PhiML writes eager's message
                    real = SolveInfo(info.solve, *values, info.method, info.msg, info.solve_time)
                    original(real, only_warn)
                finally:
                    CHECKING.reset(token)

            converged = _positions(info.converged, natives)
            diverged = _positions(info.diverged, natives)
            known = None if converged is None or diverged is None else (converged, diverged)
            collector.add(Deferred(key, check, len(natives), info, known), natives)
            return None

        SolveInfo.convergence_check = convergence_check

    def remove(self) -> None:
        from phiml.math._optimize import SolveInfo

        SolveInfo.convergence_check = self.original


def _positions(flag: Any, natives: Sequence[torch.Tensor]) -> tuple[int, ...] | None:
    """Where the torch natives of the PhiML tensor ``flag`` are among ``natives`` (None: it
    has other natives, or none)."""
    own: list[torch.Tensor] = []
    disassemble(flag, own)
    positions = tuple(
        next((i for i, n in enumerate(natives) if n is native), -1) for native in own
    )  # fmt: skip
    return positions if own and -1 not in positions else None


def _with_message(info: Any) -> Any:
    """``info`` built anew while its values count as available: PhiML formats the message
    (``did not converge to rel_tol=... Max residual: ...``) only then; the solve ran while
    PhiML saw our pass as its jit, so its own ``SolveInfo`` kept the raw message."""
    from phiml.math._optimize import SolveInfo

    return SolveInfo(info.solve, info.x, info.residual, info.iterations,
                     info.function_evaluations, info.converged, info.diverged, info.method,
                     info.msg, info.solve_time)  # fmt: skip


_CHECK_PATCH = _ConvergenceCheck()
CHECKS = RefCounted(_CHECK_PATCH.install, _CHECK_PATCH.remove)


CHECKING: ContextVar[bool] = ContextVar("phi_torch_jit_checking", default=False)


@dataclass(frozen=True)
class Deferred:
    """A ``math.when_available`` callback met while tracing, with how to rebuild its args."""

    key: PhiKey
    """Structure of the PhiML tensors it receives."""
    runnable: Any
    """The callback."""
    count: int
    """How many torch natives the program returns for it."""
    solve_info: Any = None
    """For a convergence check: the ``SolveInfo`` it was met with (solve, method, message),
    from which :func:`solve_infos` rebuilds one around the program's tensors."""
    flags: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    """For a convergence check: which natives are its ``converged`` and its ``diverged``
    flags (None: unknown). All converged and none diverged, the check passes without the
    ``SolveInfo`` built (about 0.5 ms a call: PhiML formats its message)."""

    def call(self, natives: Sequence[torch.Tensor]) -> None:
        if self.flags is not None:
            converged, diverged = self.flags
            if all(bool(natives[i].all()) for i in converged) and not any(
                bool(natives[i].any()) for i in diverged
            ):
                return
        self.runnable(*assemble(self.key, iter(natives)))


def solve_infos(checks: Sequence[Deferred], natives: Sequence[Any], real: bool) -> list[Any]:
    """The ``SolveInfo`` of each convergence check among ``checks``, rebuilt around the
    tensors the program returned for it (``real``: values, so PhiML formats its message).
    NOTE [SolveTape under jit]."""
    from phiml.math._optimize import SolveInfo

    infos, start = [], 0
    for check in checks:
        values = natives[start : start + check.count]
        start += check.count
        template = check.solve_info
        if template is None:
            continue
        token = CHECKING.set(real)
        try:
            parts = assemble(check.key, iter(values))
            infos.append(SolveInfo(template.solve, *parts, template.method, template.msg,
                                   template.solve_time))  # fmt: skip
        finally:
            CHECKING.reset(token)
    return infos


def open_tapes() -> tuple[Any, ...]:
    """PhiML's ``SolveTape``s open now (none if PhiML's optimizer is not imported)."""
    optimize = sys.modules.get("phiml.math._optimize")
    return tuple(optimize._SOLVE_TAPES) if optimize is not None else ()


@contextmanager
def tapes_set_aside() -> Iterator[None]:
    """While a solve's forward is traced (compiled), its SolveInfo holds tracer values: the
    open tapes are set aside, and a throwaway tape stands in for them, so the solve computes
    what it computes for a tape (its residual)."""
    optimize = sys.modules.get("phiml.math._optimize")
    if optimize is None or not optimize._SOLVE_TAPES:
        yield
        return
    tapes = optimize._SOLVE_TAPES
    saved = list(tapes)
    tapes[:] = [optimize.SolveTape()]
    try:
        yield
    finally:
        tapes[:] = saved


def add_to_tapes(infos: Sequence[Any], skip: tuple[Any, ...] = ()) -> None:
    """Add ``infos`` to the open ``SolveTape``s, except those in ``skip``, as PhiML's solve
    does after it ran (trajectories are not recorded: NOTE [SolveTape under jit])."""
    for tape in open_tapes():
        if all(tape is not s for s in skip):
            for info in infos:
                tape._add(info.solve, False, info)
