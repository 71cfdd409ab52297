"""Stage 4: the replay cursor: hands out recorded custom calls in order, and checks itself.

During the trace pass the user function runs again on the same inputs, so it
must call the same custom functions, in the same order, with the same static
arguments, as during the record pass. The cursor knows which call comes next
and raises :class:`~.errors.ReplayError` with the expected and actual
function and index as soon as the trace diverges; :meth:`ReplayCursor.finish`
catches calls that the trace skipped. It walks the steps that stage 2 made
(:class:`._custom_op.ReplayStep`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from .errors import ReplayError, RunEagerly

if TYPE_CHECKING:
    from ._context import CustomCallee
    from ._custom_op import ReplayStep

__all__ = ["ReplayCursor"]

_FIX = (
    " A jitted function must call its custom functions in the same order, with the same "
    "non-tensor arguments, on every run with the same inputs; keep randomness and global "
    "state out of the Python that decides which custom functions run."
)


class ReplayCursor:
    """Yields the recorded custom calls of one jitted call in order."""

    def __init__(self, steps: Sequence[ReplayStep], owner: str) -> None:
        self._steps = tuple(steps)
        self._owner = owner
        self._index = 0

    @property
    def steps(self) -> tuple[ReplayStep, ...]:
        """The recorded calls, in order."""
        return self._steps

    @property
    def position(self) -> int:
        """How many calls have been replayed."""
        return self._index

    def call(self, function: CustomCallee, args: tuple[Any, ...]) -> tuple[Any, Any]:
        """The trace pass's call of ``function``: (the recorded outputs, which its op returns
        into the trace, the recorded call context); raises as :meth:`next` does."""
        step = self.next(function, args)
        return step.compiled.replay(step.recorded, args), step.recorded.context

    def next(self, function: CustomCallee, args: tuple[Any, ...]) -> ReplayStep:
        """The step for this call; raises ReplayError if it is not the one recorded next."""
        index = self._index
        if index >= len(self._steps):
            raise ReplayError(
                f"phi_torch_jit: while tracing {self._owner}, custom function {function.label} "
                f"was called as call #{index + 1}, but the record pass made only "
                f"{len(self._steps)} custom-function calls." + _FIX
            )
        step = self._steps[index]
        expected = step.recorded.function
        if not expected.matches(function):
            raise ReplayError(
                f"phi_torch_jit: while tracing {self._owner}, custom-function call #{index + 1} "
                f"was {function.label}, but the record pass called {expected.label} there." + _FIX
            )
        self._check_static(step.recorded.args, args, index, function)
        self._index += 1
        return step

    def _check_static(
        self,
        recorded: tuple[Any, ...],
        actual: tuple[Any, ...],
        index: int,
        function: CustomCallee,
    ) -> None:
        """Non-tensor arguments must be the same values as recorded, or the run goes eager.

        Objects created anew on every call (a lambda closing over a tensor of
        the step, a wrapper built by a library) would be baked into the
        compiled call as their first-call version: a silently stale result.
        """
        for position, (old, new) in enumerate(zip(recorded, actual)):
            if isinstance(old, torch.Tensor) or isinstance(new, torch.Tensor):
                continue
            if old is new or _equal(old, new):
                continue
            raise RunEagerly(
                f"argument {position} of custom-function call #{index + 1} ({function.label}) is "
                f"a new {type(new).__name__} object on every call (a lambda or wrapper created "
                "inside the jitted function?), so a compiled program would keep the first one. "
                "Pass the tensors it uses as arguments of the custom function to compile it"
            )

    def finish(self) -> None:
        """Check that every recorded call was replayed."""
        if self._index != len(self._steps):
            missing = self._steps[self._index].recorded.function.label
            raise ReplayError(
                f"phi_torch_jit: while tracing {self._owner}, only {self._index} of "
                f"{len(self._steps)} recorded custom-function calls happened; the first missing "
                f"one is {missing}." + _FIX
            )


def _equal(old: Any, new: Any) -> bool:
    try:
        return type(old) is type(new) and bool(old == new)
    except Exception:  # comparisons that raise or return arrays: not provably equal
        return False
