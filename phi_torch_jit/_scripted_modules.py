"""Stage 5, for TorchScript modules the step calls (``torch.jit.script(net)``): what a trace
bakes of them, compared before every compiled call.

A scripted module keeps its parameters, buffers, submodules and attributes in its C++ object,
behind wrappers that are not dicts (``OrderedDictWrapper``), so the module guard's dict-based
checks cannot read them: ``s.k = 7.0`` (a float attribute its TorchScript ``forward`` reads,
baked into the trace as a constant) went unseen, and ``s.bias = nn.Parameter(...)`` crashed
the guard (probe 43b). Here each such module's state is read through those wrappers, once per
call: its training flag, which tensor each parameter and buffer slot holds (with dtype, device,
shape and ``requires_grad``), which module each child slot holds, and its attributes of plain
values (numbers, strings, tuples of them: by type and ``repr``, so ``2`` and ``2.0``, ``0.0``
and ``-0.0`` differ). Any change retraces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ._reads._records import immutable

__all__ = ["scripted", "ScriptedState"]

_OWN = frozenset(("training", "_is_full_backward_hook"))
"""Attributes every scripted module has, checked otherwise (training) or not read by code."""


def scripted(module: nn.Module) -> bool:
    """Whether ``module`` is a TorchScript module (its state lives in C++)."""
    return isinstance(module, torch.jit.ScriptModule)


def _tensors(items: Any) -> tuple[Any, ...]:
    return tuple(
        (name, None) if t is None else (name, id(t), t.dtype, t.device, t.shape, t.requires_grad)
        for name, t in items
    )


def _attribute_names(module: nn.Module) -> tuple[str, ...]:
    """The names of a scripted module's attributes that hold plain values when traced."""
    try:
        names = getattr(module, "_concrete_type").get_attributes()  # noqa: B009 (not typed)
    except (AttributeError, RuntimeError):  # a module loaded with torch.jit.load: no Python type
        return ()
    return tuple(n for n in names if n not in _OWN and immutable(_attribute(module, n)))


def _attribute(module: nn.Module, name: str) -> Any:
    try:
        return getattr(module, "_c").getattr(name)  # noqa: B009 (not typed)
    except RuntimeError:  # gone
        return _GONE


_GONE = object()


def _state(module: nn.Module, names: tuple[str, ...]) -> tuple[Any, ...]:
    children = tuple((n, id(m)) for n, m in module._modules.items())
    values = tuple((n, type(v), repr(v)) for n in names for v in (_attribute(module, n),))
    return (module.training, _tensors(module._parameters.items()),
            _tensors(module._buffers.items()), children, values)  # fmt: skip


class ScriptedState:
    """The state of the scripted modules among those a trace called."""

    def __init__(self, modules: Sequence[tuple[str, nn.Module]]) -> None:
        self.named = tuple(modules)
        self._names = tuple(_attribute_names(m) for _, m in self.named)
        self._states = self._now()

    def _now(self) -> tuple[tuple[Any, ...], ...]:
        return tuple(_state(m, names) for (_, m), names in zip(self.named, self._names))

    def holds(self) -> bool:
        """Whether every scripted module is as it was traced."""
        return self._now() == self._states

    def describe_change(self) -> str | None:
        """What changed, e.g. ``TorchScript module M: attribute k 2.0 -> 7.0``; None: nothing."""
        parts = ("training", "parameters", "buffers", "submodules")
        for (name, _), was, now in zip(self.named, self._states, self._now()):
            for part, old, new in zip((*parts, "attributes"), was, now):
                if old == new:
                    continue
                if part != "attributes":
                    return f"TorchScript module {name}: its {part} changed"
                changed = [f"{a[0]} {a[2]} -> {b[2]}" for a, b in zip(old, new) if a != b]
                return f"TorchScript module {name}: attribute {', '.join(changed)}"
        return None
