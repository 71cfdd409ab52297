"""Custom functions: a forward ``f`` with a hand-written ``gradient``.

A :class:`CustomFunction` behaves in three ways, chosen by the current frame
(see :mod:`._context`):

* **eager** (no jitted call is being specialized, or the engine is eager):
  it is an ordinary ``torch.autograd.Function``, generated at run time and
  named after ``f`` so that ``grad_fn`` reads well;
* **record**: the same eager call, plus a :class:`~._record.RecordedCall`
  with copies of its inputs and outputs;
* **trace**: the replay cursor hands out the compiled call that stage 2 made
  from the recording; its opaque op returns the recorded outputs, so ``f``
  does not run a second time.

The contract checks (``f`` returns tensors; ``gradient`` returns one entry per
input with the input's shape, or None) live here so that eager and compiled
calls enforce the same rules.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ._compat import get_tracing_state, set_tracing_state
from ._context import CustomCallee, Phase, call_state, current_frame, inside_custom_function
from ._sources import is_user_file
from .errors import CustomFunctionError, GradientError, UsageError, describe_function

__all__ = ["CustomFunction", "custom_gradient", "split_tensors", "merge_tensors", "untraced"]

logger = logging.getLogger("phi_torch_jit")

GradientFn = Callable[
    [tuple[Any, ...], tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]],
    Sequence[torch.Tensor | None] | torch.Tensor | None,
]


@contextmanager
def untraced() -> Iterator[None]:
    """Hide a running trace, so contract checks on shapes do not enter the graph."""
    state = get_tracing_state()
    if state is None:
        yield
        return
    set_tracing_state(None)
    try:
        yield
    finally:
        set_tracing_state(state)


class _TensorSlot:
    """Placeholder for a tensor argument in a template of static values."""

    def __repr__(self) -> str:
        return "<tensor>"


TENSOR = _TensorSlot()


def split_tensors(args: Sequence[Any]) -> tuple[list[torch.Tensor], tuple[Any, ...]]:
    """Split arguments into (tensors, template with TENSOR where each tensor was)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    template = tuple(TENSOR if isinstance(a, torch.Tensor) else a for a in args)
    return tensors, template


def merge_tensors(template: Sequence[Any], tensors: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    """Inverse of :func:`split_tensors`: put tensors back into their slots."""
    it = iter(tensors)
    return tuple(next(it) if a is TENSOR else a for a in template)


class CustomFunction:
    """``f`` with a user-defined ``gradient``; see :func:`custom_gradient`."""

    def __init__(self, f: Callable[..., Any], gradient: GradientFn, name: str | None = None):
        if not callable(f) or not callable(gradient):
            raise UsageError(
                "phi_torch_jit: custom_gradient(f, gradient) needs two callables, got "
                f"{type(f).__name__} and {type(gradient).__name__}."
            )
        self.f = f
        self.gradient = gradient
        self.__name__: str = name or getattr(f, "__name__", None) or type(f).__name__
        self.__doc__ = getattr(f, "__doc__", None)
        self.label = describe_function(f, name)
        self.scriptable: Callable[..., Any] | None = f
        """What an engine may script when all arguments are tensors (None: never)."""
        self._autograd = _make_autograd_function(self)
        self._fallback_logged = False
        code = getattr(inspect.unwrap(f), "__code__", None)
        self.user_code = code is None or is_user_file(code.co_filename)
        """Whether ``f`` is the user's code (not a library's), for the level of notices."""

    def __repr__(self) -> str:
        return f"<custom function {self.label}>"

    def __call__(self, *args: Any) -> Any:
        return self.call(args)[0]

    def call(self, args: tuple[Any, ...]) -> tuple[Any, Any]:
        """One call in the current phase: (outputs as ``f`` returns them, call context).

        Eager (no frame): the generated autograd.Function. Record: the same, and the call is
        recorded. Compile: a nested compiled call. Trace: the replay cursor's next recorded
        call, whose op returns the recorded outputs. The call context is what the forward
        left for its backward (NOTE [call context]); None for plain custom functions.
        """
        frame = current_frame()
        if frame is None:
            return self._autograd.apply(*args), None
        if frame.phase is Phase.RECORD:
            assert frame.recording is not None
            outputs = self._autograd.apply(*args)
            context = call_state().last_context
            frame.recording.add_call(self, args, outputs, context)
            return outputs, context
        if frame.phase is Phase.COMPILE:
            assert frame.nested is not None
            return frame.nested.call(self, args)
        assert frame.cursor is not None
        return frame.cursor.call(self, args)

    # -- the contract, shared by eager and compiled calls ------------------------------

    def run_forward(
        self, args: Sequence[Any], source: Callable[..., Any] | None = None
    ) -> tuple[tuple[torch.Tensor, ...], bool]:
        """Run ``f``; return (outputs as a tuple of tensors, whether it was a bare tensor).
        ``source``: a function to run in place of :attr:`loop_source` (the same function with
        its loops captured, ``phi_torch_jit._loops``).

        The call context it leaves is this thread's ``call_state().last_context``.
        """
        with inside_custom_function(args, self.label):
            out, context = self._forward(tuple(args), source)
        call_state().last_context = context
        return self.check_outputs(out)

    def _forward(self, args: tuple[Any, ...], source: Any = None) -> tuple[Any, Any]:
        """``f``'s raw result and the call context it leaves (None for plain functions)."""
        return (source or self.f)(*args), None

    @property
    def loop_source(self) -> Callable[..., Any]:
        """The user's function whose loops an engine may capture (its source is read); the
        forward calls it with the call's arguments."""
        return self.f

    def check_outputs(self, out: Any) -> tuple[tuple[torch.Tensor, ...], bool]:
        """Validate what ``f`` returned; return (outputs as tuple, whether it was a bare tensor)."""
        if isinstance(out, torch.Tensor):
            return (out,), True
        if isinstance(out, (tuple, list)) and out:
            for i, o in enumerate(out):
                if not isinstance(o, torch.Tensor):
                    raise CustomFunctionError(
                        f"phi_torch_jit: the forward function {self.label} of a custom function "
                        f"returned {type(o).__name__} as output {i}; it must return a tensor or a "
                        "tuple of tensors. Return non-tensor results from the calling function."
                    )
            return tuple(out), False
        raise CustomFunctionError(
            f"phi_torch_jit: the forward function {self.label} of a custom function returned "
            f"{type(out).__name__}; it must return a tensor or a non-empty tuple of tensors."
        )

    def gradients(
        self,
        inputs: tuple[Any, ...],
        outputs: tuple[torch.Tensor, ...],
        grad_outputs: tuple[torch.Tensor, ...],
        needs_input_grad: tuple[bool, ...] | None = None,
        context: Any = None,
        source: Callable[..., Any] | None = None,
    ) -> tuple[torch.Tensor | None, ...]:
        """Call ``gradient`` and validate its result: one entry per input, shaped like it.

        ``context`` is the call context the forward call these gradients are for left
        (None for plain custom functions). ``source``: a function to run in place of
        :attr:`gradient_source` (the same function with its loops captured).
        """
        with inside_custom_function((*inputs, *outputs, *grad_outputs), self.label):
            result = self._call_gradient(
                inputs, outputs, grad_outputs, needs_input_grad, context, source
            )
        with untraced():
            return self.check_gradients(result, inputs, needs_input_grad)

    def _call_gradient(
        self,
        inputs: tuple[Any, ...],
        outputs: tuple[torch.Tensor, ...],
        grad_outputs: tuple[torch.Tensor, ...],
        needs_input_grad: tuple[bool, ...] | None,
        context: Any,
        source: Callable[..., Any] | None = None,
    ) -> Any:
        return (source or self.gradient)(inputs, outputs, grad_outputs)

    @property
    def gradient_source(self) -> Callable[..., Any]:
        """The user's gradient function whose loops an engine may capture (its source is
        read); the backward calls it as :meth:`gradients` does."""
        return self.gradient

    def matches(self, other: CustomCallee) -> bool:
        """Whether a call of ``other`` in the trace pass replays a recorded call of ``self``."""
        return other is self

    def check_gradients(
        self,
        result: Any,
        inputs: tuple[Any, ...],
        needs_input_grad: tuple[bool, ...] | None = None,
    ) -> tuple[torch.Tensor | None, ...]:
        """Validate ``gradient``'s result against the inputs it is for. An entry for an input
        that needs no gradient is dropped unchecked (None), as eager autograd ignores it (an
        adjoint solver returns something for every argument)."""
        if (result is None or isinstance(result, torch.Tensor)) and len(inputs) == 1:
            result = (result,)
        if not isinstance(result, (tuple, list)) or len(result) != len(inputs):
            got = len(result) if isinstance(result, (tuple, list)) else type(result).__name__
            raise GradientError(
                f"phi_torch_jit: the gradient of {self.label} returned {got} entries for "
                f"{len(inputs)} inputs. Return a sequence with one entry per input of f, "
                "None where an input gets no gradient."
            )
        result = list(result)
        for i, (g, x) in enumerate(zip(result, inputs)):
            needed = needs_input_grad is None or i >= len(needs_input_grad) or needs_input_grad[i]
            if not needed and isinstance(x, torch.Tensor):
                result[i] = None
                continue
            if g is None:
                continue
            if not isinstance(g, torch.Tensor):
                raise GradientError(
                    f"phi_torch_jit: entry {i} of the gradient of {self.label} is "
                    f"{type(g).__name__}; return a tensor or None."
                )
            if not isinstance(x, torch.Tensor):
                raise GradientError(
                    f"phi_torch_jit: entry {i} of the gradient of {self.label} is a tensor, but "
                    f"input {i} is {type(x).__name__}; return None for non-tensor inputs."
                )
            if g.shape != x.shape and _expandable(x.shape, g.shape):
                result[i] = g.sum_to_size(x.shape)  # as eager autograd does (a broadcast input)
            elif g.shape != x.shape:
                raise GradientError(
                    f"phi_torch_jit: entry {i} of the gradient of {self.label} has shape "
                    f"{tuple(g.shape)}, expected {tuple(x.shape)} (the shape of input {i}). "
                    "Return a gradient shaped like its input (or like its broadcast)."
                )
        return tuple(result)

    def note_python_fallback(self, what: str, reason: str) -> None:
        """Log once per custom function that part of it runs as Python when compiled.

        A warning for the user's own functions (they can make them scriptable); for a
        library's (PhiML's pressure solve) only at INFO: it is correct, and nothing to act on.
        """
        if not self._fallback_logged:
            self._fallback_logged = True
            level = logging.WARNING if self.user_code else logging.INFO
            logger.log(
                level,
                "phi_torch_jit: the %s of %s runs as Python inside the compiled program: %s",
                what,
                self.label,
                reason,
            )


def _make_autograd_function(function: CustomFunction) -> type[torch.autograd.Function]:
    """Generate the eager autograd.Function of ``function``, named after ``f``."""

    def forward(ctx: Any, *args: Any) -> Any:
        outputs, single = function.run_forward(args)
        tensors, template = split_tensors(args)
        ctx.template = template
        ctx.n_inputs = len(tensors)
        ctx.save_for_backward(*tensors, *outputs)
        ctx.call_context = call_state().last_context
        return outputs[0] if single else outputs

    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors
        inputs = merge_tensors(ctx.template, saved[: ctx.n_inputs])
        outputs = tuple(saved[ctx.n_inputs :])
        needs = tuple(ctx.needs_input_grad)
        return function.gradients(inputs, outputs, grad_outputs, needs, ctx.call_context)

    name = "".join(part.capitalize() for part in function.__name__.split("_")) or "Custom"
    return type(
        f"{name}Function",
        (torch.autograd.Function,),
        {
            "forward": staticmethod(forward),
            "backward": staticmethod(backward),
            "_phi_torch_jit_internal": True,  # not captured by the autograd.Function adapter
        },
    )


def custom_gradient(
    f: Callable[..., Any], gradient: GradientFn, *, name: str | None = None
) -> CustomFunction:
    """Attach a hand-written gradient to ``f``.

    Contract: ``f(*args)`` returns a tensor or a tuple of tensors; arguments
    may be tensors or static values (float tolerances, ints, None, callables).
    ``gradient(inputs, outputs, grad_outputs)`` receives tuples of ``f``'s
    arguments, its outputs and the gradients of the outputs, and returns one
    entry per argument of ``f``: a tensor shaped like that argument, or None
    ("no gradient"; required for non-tensor arguments).

    Outside :func:`~phi_torch_jit.jit` the result is an ordinary autograd
    function. Inside, ``f`` runs once eagerly on a cache miss and is then
    compiled on the recorded inputs; ``gradient`` is compiled at the first
    backward that reaches it, once per pattern of inputs that need gradients.
    A function whose Python control flow depends on tensor values (e.g. a CG
    loop ``while residual > tol``) is not baked into a fixed iteration count:
    the engine keeps the loop (scripting) or runs it as Python, logged once.

    Args:
        f: the forward function.
        gradient: the backward function described above.
        name: name for logs and ``grad_fn``; defaults to ``f.__name__``.

    Returns:
        A callable with ``f``'s calling convention.

    Raises:
        CustomFunctionError: when called, if ``f`` returns something other than tensors.
        GradientError: in backward, if ``gradient`` returns the wrong number of
            entries or a wrongly shaped one.

    Example:
        >>> def solve(b):  # an implicit step, e.g. conjugate gradients
        ...     return b / 2
        >>> solve = custom_gradient(solve, lambda inputs, outputs, grads: (grads[0] / 2,))
    """
    return CustomFunction(f, gradient, name)


def _expandable(shape: torch.Size, to: torch.Size) -> bool:
    """Whether ``shape`` broadcasts to ``to`` (autograd then sums a gradient of ``to`` down)."""
    if len(shape) > len(to):
        return False
    return all(a == b or a == 1 for a, b in zip(reversed(shape), reversed(to)))
