"""Stage 1 (reads), the modules' hooks: what the hooks of the modules that ran read.

Hooks are traced in (their Python runs in the record and trace passes, not on compiled calls),
and checked by identity by the module guard. What a hook *reads* (a forward hook scaling by a
closure's ``cfg["k"]``, a bound method's ``self.factor``, a partial's keywords, globals) is
walked like a callable passed as an argument: :func:`hook_reads`. What a hook *changes* (a
call counter, a list of activations it appends to) is the hook's own business: those reads
changed between the record and the trace pass, and :func:`held_by_hooks` drops them, so a
counting hook neither retraces every call nor makes the step eager.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from .._compat import MODULE_HOOK_DICTS, global_module_hooks
from .._sources import OWN_DIR
from ._python import collect_reads
from ._records import Kind, Read

__all__ = ["hook_reads", "held_by_hooks"]


def hook_reads(modules: Sequence[nn.Module], reads: Sequence[Read] = ()) -> list[Read]:
    """What the hooks of ``modules``, of the modules among ``reads`` (read, not called: the
    step may call their hooks itself, ``for h in m._forward_hooks.values()``, probe 49) and
    torch's global module hooks read (ours left out: the record pass's module hook)."""
    hooks: list[Any] = []
    read = [
        r.expected for r in reads if r.kind is Kind.IDENTITY and isinstance(r.expected, nn.Module)
    ]
    for module in {id(m): m for m in (*modules, *read)}.values():
        for name in MODULE_HOOK_DICTS:
            hooks += list(getattr(module, name, {}).values())
    for table in global_module_hooks():
        hooks += list(table.values())
    hooks = [hook for hook in hooks if not _ours(hook)]
    return collect_reads(None, (), hooks, role="a hook") if hooks else []


def _ours(hook: Any) -> bool:
    code = getattr(hook, "__code__", None)
    return code is not None and code.co_filename.startswith(OWN_DIR)


def held_by_hooks(reads: Sequence[Read], hooks_read: Sequence[Read]) -> list[Read]:
    """``reads`` without what the hooks changed since ``hooks_read`` were taken (between the
    record and the trace pass: the hook's own state, a counter); tensors stay (program
    inputs)."""
    changed = {id(r) for r in hooks_read if r.kind is not Kind.TENSOR and not r.holds()}
    return [r for r in reads if id(r) not in changed]
