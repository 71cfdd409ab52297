"""FX's class patches made per thread (private API entry ``FX_PATCHER``).

FX's tracer replaces ``nn.Module.__call__`` and ``__getattr__`` on the class while it traces,
for every thread. While :func:`fx_patches_per_thread`'s patch is installed (while any thread
holds a tracing lock, ``engines._tracing_lock``), each replacement acts on the thread that
traces, and every other thread keeps the originals. The function installed here relays calls:
``_value_guards`` looks through its frame (a read inside it is the caller's, not ours).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

from ._private import FX_PATCHER

__all__ = ["fx_patches_per_thread"]


def fx_patches_per_thread() -> tuple[Callable[[], None], Callable[[], None]]:
    """(install, remove): while installed, the class methods FX's tracer replaces while it
    traces (``nn.Module.__call__``, ``__getattr__``) are replaced for the tracing thread only;
    other threads keep calling the originals."""
    patcher = importlib.import_module("torch.fx._symbolic_trace")._Patcher
    FX_PATCHER.find()
    saved: list[Any] = []

    def patch_method(
        self: Any, cls: type, name: str, new_fn: Callable[..., Any], deduplicate: bool = True
    ) -> None:
        original = getattr(cls, name)
        if getattr(original, "__fx_already_patched", False):  # FX's own deduplication
            return
        owner = threading.get_ident()

        def on_tracing_thread(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == owner:
                return new_fn(*args, **kwargs)
            return original(*args, **kwargs)

        saved[0](self, cls, name, on_tracing_thread, deduplicate)

    def install() -> None:
        saved.append(patcher.__dict__["patch_method"])
        patcher.patch_method = patch_method

    def remove() -> None:
        patcher.patch_method = saved.pop()

    return install, remove
