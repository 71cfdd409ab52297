"""Stage 2, at the first backward: a compiled call's backward, per needs-input-grad pattern.

Which inputs need a gradient is only known at backward time, and it can
change from call to call (train the source, then the initial state). A
backward compiled for one pattern must never serve another: the ancestor
did, and silently returned None for inputs that needed gradients later.
:class:`LazyBackward` therefore keeps one :class:`BackwardSpecialization`
per pattern, built at the first backward that shows the pattern.

A compiled function cannot return None, so gradients the user returns as
None (or that are not needed) are dropped from the compiled outputs by
:func:`drop_none` and put back by :func:`restore_none`. See NOTE [None
gradients] in docs/design.md.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ._context import raised_by_check
from ._custom import TENSOR, merge_tensors
from ._phases import compiling
from .engines import CompiledFunction, Engine, FunctionTarget
from .errors import NotNow

if TYPE_CHECKING:
    from ._context import CustomCalls
    from ._custom import CustomFunction

__all__ = ["drop_none", "restore_none", "BackwardSpecialization", "LazyBackward"]


def drop_none(
    values: Sequence[torch.Tensor | None],
) -> tuple[tuple[torch.Tensor, ...], tuple[bool, ...]]:
    """Split into (the tensors, a mask saying where each entry was a tensor)."""
    present = tuple(v is not None for v in values)
    return tuple(v for v in values if v is not None), present


def restore_none(
    values: Sequence[torch.Tensor], present: Sequence[bool]
) -> tuple[torch.Tensor | None, ...]:
    """Inverse of :func:`drop_none`."""
    it = iter(values)
    restored = tuple(next(it) if p else None for p in present)
    assert next(it, None) is None, "more values than present entries"
    return restored


@dataclass(frozen=True)
class BackwardSpecialization:
    """The compiled backward for one needs-input-grad pattern."""

    pattern: tuple[bool, ...]
    """needs_input_grad of the tensor inputs."""
    present: tuple[bool, ...]
    """Which tensor inputs get a gradient from ``compiled`` (the others get None)."""
    compiled: CompiledFunction | None
    """Flat backward ``(inputs, outputs, grad_outputs) -> present gradients``; None if none."""
    context: Any = None
    """The call context it was compiled with; other contexts run the Python backward."""

    @property
    def mode(self) -> str:
        return self.compiled.mode if self.compiled is not None else "none"


class _GradientProbe:
    """The flat backward for one pattern; remembers what its last run returned."""

    def __init__(
        self,
        function: CustomFunction,
        template: tuple[object, ...],
        n_outputs: int,
        pattern: tuple[bool, ...],
        source: Any = None,
    ) -> None:
        self.function = function
        self.source = source
        """Runs in place of the function's ``gradient_source`` (its loops captured)."""
        self.template = template
        self.n_inputs = len(pattern)
        self.n_outputs = n_outputs
        self.pattern = pattern
        self.present: tuple[bool, ...] = ()
        self.last_values: tuple[torch.Tensor, ...] | None = None
        """Result of the last complete run (the engine's compile run computes real values)."""
        self.context: Any = None
        """The call context that compiling runs use."""

    def masked(
        self, flat: Sequence[torch.Tensor], context: Any = None
    ) -> tuple[torch.Tensor | None, ...]:
        """Gradients of the tensor inputs, None where not needed or not given."""
        n, m = self.n_inputs, self.n_outputs
        inputs = merge_tensors(self.template, flat[:n])
        needs = iter(self.pattern)
        full_pattern = tuple(next(needs) if slot is TENSOR else False for slot in self.template)
        outputs, grad_outputs = tuple(flat[n : n + m]), tuple(flat[n + m :])
        context = self.context if context is None else context
        grads = self.function.gradients(
            inputs, outputs, grad_outputs, full_pattern, context, self.source
        )
        tensor_grads = [g for g, slot in zip(grads, self.template) if slot is TENSOR]
        return tuple(g if need else None for g, need in zip(tensor_grads, self.pattern))

    def __call__(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.last_values, self.present = drop_none(self.masked(flat))
        return self.last_values

    def with_source(self, source: Any) -> _GradientProbe:
        """This backward with ``source`` run in place of the user's gradient function."""
        probe = _GradientProbe(self.function, self.template, self.n_outputs, self.pattern, source)
        probe.context = self.context
        return probe

    def reference(self, flat: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The Python backward's gradients for ``flat`` (what a captured one must equal), when
        the engine's compile run did not leave them in :attr:`last_values`."""
        return drop_none(self.masked(flat, self.context))[0]


class LazyBackward:
    """Backward of one compiled custom call; compiles one specialization per pattern."""

    def __init__(
        self,
        function: CustomFunction,
        template: tuple[object, ...],
        n_outputs: int,
        engine: Engine,
        nested: CustomCalls,
    ) -> None:
        self.function = function
        self.template = template
        self.n_outputs = n_outputs
        self.engine = engine
        self.nested = nested
        self._specializations: dict[tuple[bool, ...], BackwardSpecialization] = {}
        self._probes: dict[tuple[bool, ...], _GradientProbe] = {}
        self._lock = threading.Lock()

    @property
    def specializations(self) -> Mapping[tuple[bool, ...], BackwardSpecialization]:
        """Patterns seen so far and how each is compiled."""
        return dict(self._specializations)

    def __call__(
        self,
        pattern: tuple[bool, ...],
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor],
        grad_outputs: Sequence[torch.Tensor],
        context: Any = None,
    ) -> tuple[torch.Tensor | None, ...]:
        """Gradients for the tensor inputs (None where not needed or not given).

        ``context`` is the forward call's context (NOTE [call context]); a compiled backward
        is used only for the context it was compiled with.
        """
        flat = (*inputs, *outputs, *grad_outputs)
        if torch.is_grad_enabled():  # create_graph=True: a compiled backward is opaque
            return self._differentiable(pattern, flat, context)
        spec = self._specializations.get(pattern)
        if spec is None:
            with self._lock:
                return self._build(pattern, flat, context)
        if spec.compiled is None:
            return (None,) * len(pattern)
        if spec.compiled.mode == "python" or spec.context != context:
            return self._probes[pattern].masked(flat, context)
        try:
            return restore_none(spec.compiled.run(*flat), spec.present)
        except Exception as error:
            if not raised_by_check(error):
                raise
        # A library's check in the compiled backward raised (an adjoint solve that diverged by
        # rounding): the user's gradient runs as Python for this call, raising only where it
        # raises too (NOTE [a check that fails on rounding]).
        return self._probes[pattern].masked(flat, context)

    def _differentiable(
        self, pattern: tuple[bool, ...], flat: tuple[torch.Tensor, ...], context: Any
    ) -> tuple[torch.Tensor | None, ...]:
        """The user's gradient run as Python with autograd recording, as eager autograd runs a
        Function's backward under ``create_graph=True``: its gradients differentiate again
        (a compiled backward's would not: "element 0 of tensors does not require grad")."""
        probe = self._probes.get(pattern)
        if probe is None:
            probe = _GradientProbe(self.function, self.template, self.n_outputs, pattern)
        return probe.masked(flat, context)

    def _build(
        self, pattern: tuple[bool, ...], flat: tuple[torch.Tensor, ...], context: Any
    ) -> tuple[torch.Tensor | None, ...]:
        """Compile the backward for ``pattern`` and return this backward's gradients."""
        probe = _GradientProbe(self.function, self.template, self.n_outputs, pattern)
        probe.context = context
        self._probes[pattern] = probe
        if not any(pattern):
            self._specializations[pattern] = BackwardSpecialization(pattern, pattern, None)
            return (None,) * len(pattern)
        label = f"backward of {self.function.label}"
        with compiling(self.function.label, self.nested):
            target = FunctionTarget(
                probe,
                flat,
                label,
                loop_source=self.function.gradient_source,
                with_loop_source=probe.with_source,
                reference=lambda: probe.last_values or probe.reference(flat),
            )
            try:
                compiled: CompiledFunction | None = self.engine.compile_function(target)
            except NotNow:  # the engine cannot compile without waiting: Python this time,
                compiled = None  # outside the compile phase (nested custom calls run eagerly)
        if compiled is None:
            probe.last_values = None
            return probe.masked(flat)
        if compiled.mode == "python":
            self.function.note_python_fallback("backward", compiled.reason)
        if probe.last_values is None:  # the compile run did not finish: run it as Python
            result = probe.masked(flat)
        else:
            result = restore_none(probe.last_values, probe.present)
        present = tuple(g is not None for g in result)
        probe.last_values = None
        self._specializations[pattern] = BackwardSpecialization(pattern, present, compiled, context)
        return result
