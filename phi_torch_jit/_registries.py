"""The trace phase's check on module registries: hooks, submodules, parameters and buffers.

The trace pass runs the user's Python a second time. A step that registers something on every
run (``lin.register_forward_hook(...)``, ``layers.append(Block())``, ``register_buffer`` under a
new name) did it once in the record pass and again in the trace, and compiled calls, which run
no Python, never again: eager code would have one more hook or layer per call. A step that
registers once (a buffer made on the first call, ``if not hasattr(self, "mask")``) does nothing
in the trace. The same holds for an entry replaced on every run (``lin.bias =
nn.Parameter(...)``, ``net.act = nn.Tanh()``). :class:`Registries` copies the registries of
the modules involved (and torch's global module hooks) before the trace; afterwards, what the
trace registered or replaced is put back as it was and named, and the specialization runs
eagerly, warned (NOTE [side effects once]).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from ._compat import MODULE_HOOK_DICTS, global_module_hooks
from ._phases import MODULE_HOOK

__all__ = ["Registries"]

_REGISTRIES = (*MODULE_HOOK_DICTS, "_modules", "_parameters", "_buffers")
"""The dicts of a module that a registration adds to."""


class Registries:
    """Copies of the registries of ``modules`` (and their submodules) and of torch's global
    module hooks, taken before the trace pass."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        seen: dict[int, nn.Module] = {}
        for root in modules:
            for module in root.modules():
                seen.setdefault(id(module), module)
        self._copies = [
            (f"{type(module).__name__}.{name}", table, dict(table))
            for module in seen.values()
            for name in _REGISTRIES
            if isinstance(table := module.__dict__.get(name), dict)
        ]
        self._copies += [
            (f"torch's global {kind} hooks", table, dict(table))
            for kind, table in zip(("forward pre", "forward", "backward pre", "backward"),
                                   global_module_hooks())
        ]  # fmt: skip

    def added_back_out(self) -> list[str]:
        """What the trace added to the registries (``Linear._forward_hooks``) or put in an
        entry's place (``lin.bias = nn.Parameter(...)``), each taken back out; our own
        record-pass hook (another thread's) excepted. Removals are left: a one-shot hook that
        removes itself did so in the record pass already."""
        ours = MODULE_HOOK.handle_id
        added = []
        for label, table, before in self._copies:
            new = [key for key in table if key not in before and key != ours]
            replaced = [k for k, v in before.items() if k in table and table[k] is not v]
            if new or replaced:
                added.append(label)
            for key in new:
                del table[key]
            for key in replaced:
                table[key] = before[key]
        return added
