"""Stage 3: the synthesized wrapper module that the engine traces.

``torch.jit.trace`` of a plain function turns module parameters it meets into
constants (and refuses those that require grad). Tracing a *module* instead
registers the tensors of its hierarchy, so a parameter met anywhere in the
trace becomes an attribute read: gradients reach ``param.grad`` and in-place
updates (``optimizer.step()``, ``load_state_dict``) are seen without a retrace.

The wrapper therefore holds, in a flat :class:`TensorHolder` submodule, every
parameter and buffer of the recorded modules (the same tensor objects, each
once), rebuilds the user's arguments from flat tensors, calls the user
function -- which calls the original modules, hooks and all -- and flattens
its result. Holding tensors rather than the modules themselves keeps
torch.jit's module conversion (which rejects modules with backward hooks and
some attribute types) out of the way. Its class is named after the user
function so traced graphs and errors read well.
"""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn

from ._context import current_frame
from ._reads._records import Source
from ._rebinding import rebind
from ._signature import Spec, flatten_outputs, unflatten_arguments
from ._state import buffer_slots, put_back
from .errors import RunEagerly

__all__ = ["TensorHolder", "WrapperModule", "make_wrapper", "module_names"]


def module_names(modules: Sequence[nn.Module]) -> list[str]:
    """Attribute-safe names for recorded modules: ``m0_Linear``, ``m1_Sequential``..."""
    return [f"m{i}_{type(m).__name__}" for i, m in enumerate(modules)]


class TensorHolder(nn.Module):
    """Holds the parameters and buffers of some modules, by reference, each once."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        super().__init__()
        seen: set[int] = set()
        for prefix, module in zip(module_names(modules), modules):
            for name, param in module.named_parameters(remove_duplicate=False):
                if id(param) not in seen:
                    seen.add(id(param))
                    self.register_parameter(_attr(prefix, name), param)
            for name, buffer in module.named_buffers(remove_duplicate=False):
                if id(buffer) not in seen:
                    seen.add(id(buffer))
                    self.register_buffer(_attr(prefix, name), buffer)


def _attr(prefix: str, name: str) -> str:
    return f"{prefix}__{name.replace('.', '__')}"


class WrapperModule(nn.Module):
    """Calls a user function on flat tensors; holds the tensors of the modules it uses."""

    fn: Callable[..., Any]
    arg_spec: Spec
    owner: str
    captured: tuple[Source, ...]
    recorded: tuple[nn.Module, ...]

    def __init__(
        self,
        fn: Callable[..., Any],
        arg_spec: Spec,
        modules: Sequence[nn.Module],
        owner: str,
        captured: Sequence[Source] = (),
    ) -> None:
        super().__init__()
        # Plain attributes, set past nn.Module.__setattr__ so a module `fn` is not registered.
        object.__setattr__(self, "fn", fn)
        object.__setattr__(self, "arg_spec", arg_spec)
        object.__setattr__(self, "owner", owner)
        object.__setattr__(self, "captured", tuple(captured))
        object.__setattr__(self, "recorded", tuple(modules))
        self.tensors = TensorHolder(modules)

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``forward``, without torch's global module hooks (``register_module_forward_pre_hook``):
        they are the user's, for the user's modules, which the function calls; run on this
        stand-in too, a hook shifting every module's input was applied twice by compiled
        calls."""
        return self.forward(*tensors)

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = len(tensors) - len(self.captured)
        args, kwargs = unflatten_arguments(self.arg_spec, tensors[:n])
        frame = current_frame()
        if frame is None:  # eager: the function reads its globals and closures itself
            return tuple(flatten_outputs(self.fn(*args, **kwargs), self.owner)[1])
        slots = buffer_slots(self.recorded)
        with _rebound(self.captured, tensors[n:]):  # globals read the traced inputs
            result = self.fn(*args, **kwargs)
        spec, flat = flatten_outputs(result, self.owner)
        frame.outputs.spec = spec  # the trace stage returns what the trace saw
        if frame.conversions:  # value guards: see _value_guards
            flat += [c.tensor for c in frame.conversions]
        flat += (
            frame.outputs.deferred_tensors
        )  # a library's deferred callbacks (PhiML when_available)
        writes = put_back(slots)  # NOTE [side effects once]
        frame.outputs.buffer_writes = tuple(original for original, _ in writes)
        return (*flat, *(new for _, new in writes))


def make_wrapper(
    fn: Callable[..., Any],
    arg_spec: Spec,
    modules: Sequence[nn.Module],
    owner: str,
    captured: Sequence[Source] = (),
) -> WrapperModule:
    """A :class:`WrapperModule` of a subclass named after ``fn``.

    ``captured``: globals and closure variables holding tensors; they follow the arguments as
    inputs of the compiled program (NOTE [Python reads]).
    """
    try:
        name = getattr(fn, "__name__", None) or type(fn).__name__
    except Exception:  # a callable object whose __getattr__ raises KeyError (probe 50)
        name = type(fn).__name__
    ident = re.sub(r"\W", "_", name).strip("_") or "function"
    cls = type(f"{ident}_jit", (WrapperModule,), {"__module__": __name__})
    return cast(WrapperModule, cls(fn, arg_spec, modules, owner, captured))


@contextmanager
def _rebound(sources: Sequence[Source], values: Sequence[torch.Tensor]) -> Iterator[None]:
    """Bind each source to a traced input while the block runs, then back."""
    for source in sources:
        if source.in_tuple():
            raise RunEagerly(
                f"it reads a tensor kept in a tuple ({source.label}), which a compiled "
                "program cannot take as its input; keep it in a list or pass it as an "
                "argument to have it compiled"
            )
    places = [_place_of(source) for source in sources]
    saved = [place.get() for place, _ in places]
    undo: list[Callable[[], None]] = []
    try:  # NOTE [Python reads]: where each read found its tensor (_rebinding)
        for (place, bind), value, held in zip(places, values, saved):
            undo.append(rebind(place, bind(_with_attributes(value, held))))
        yield
    finally:
        for each in reversed(undo):
            each()


def _with_attributes(value: torch.Tensor, held: Any) -> torch.Tensor:
    """The traced input with the Python attributes set on the tensor it stands for (``W.scale
    = 2.0``: read by the step, guarded by value, baked by the trace)."""
    own = getattr(held, "__dict__", None) if isinstance(held, torch.Tensor) else None
    if type(own) is dict and own:
        value.__dict__.update(own)
    return value


def _place_of(source: Source) -> tuple[Source, Callable[[torch.Tensor], Any]]:
    """Where a traced input goes in place of the tensor ``source`` reads, and what is put
    there: the tensor's own place, or for the tensor a method holds bound (``MUL = W.mul``,
    ``types.MethodType(fn, W)``: ``__self__`` cannot be set) the method's place, given the
    method bound to the input (the method itself is put back after the trace: its identity is
    guarded)."""
    last = source.path[-1] if source.path else None
    if last is None or not last.attribute or last.key != "__self__":
        return source, _same
    place = dataclasses.replace(source, path=source.path[:-1])
    method = place.get()
    if isinstance(method, types.MethodType):  # types.MethodType(fn, W)
        function = method.__func__
        return place, lambda value: types.MethodType(function, value)
    if isinstance(method, types.BuiltinMethodType):
        name = method.__name__
        return place, lambda value: getattr(value, name)
    return source, _same


def _same(value: torch.Tensor) -> torch.Tensor:
    return value
