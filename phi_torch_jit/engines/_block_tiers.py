"""Blocks of captured loops served at once, compiled in the background (engine "auto").

Engine "compile" compiles each block of a captured loop (:mod:`phi_torch_jit._loops`) with
its backend when the loop first runs: in the first call of the jitted function, on the
caller's thread (inductor: 1-3 s per block, most of a first call of a CG step). Engine "auto"
with ``compile_on="background"`` instead serves the block's captured graph straight-line (the
ops called one after another, eager speed, one host check per block) and leaves the backend's
compile pending. Pending compiles are queued on the compile thread (:mod:`._background`) by
a call that queues its program's compile (a signature's third call), or by a later call of a
program whose compile is queued, together with the wrapper's compile: never while a
signature may still be met only twice (the compile holds the tracing lock, and a call of a
new signature finding it taken runs eagerly). When it
is ready, one assignment switches the block to it. Values are the same graph's on both tiers
(to float rounding).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..errors import describe_error
from ._background import exiting, submit
from ._light import straight_line

__all__ = ["BackgroundBlock", "submit_pending"]

logger = logging.getLogger("phi_torch_jit")


class BackgroundBlock:
    """A block's graph, straight-line until the backend's compile replaces it."""

    def __init__(
        self,
        graph: torch.fx.GraphModule,
        compile_now: Callable[[], Callable[..., Any]],
        lock: Any,
        remembered: bool = False,
        ahead: Callable[[], bool] | None = None,
    ) -> None:
        self.run: Callable[..., Any] = straight_line(graph)
        self.remembered = remembered
        """Whether inductor's caches hold its program (a warm start awaits its load)."""
        self.settled = threading.Event()
        """Set when its compile has ended (switched, or failed)."""
        self.straight_line = True
        """Whether the block still runs straight-line (until its compile replaced it; for good
        where it failed): a library's own loop may then be the faster one (PhiML's CG)."""
        self._compile_now: Callable[[], Callable[..., Any]] | None = compile_now
        self._lock = lock
        self._ahead = ahead
        """Run before the compile, without the lock (a compile in a worker process)."""
        with _PENDING_LOCK:
            _PENDING.append(self)

    def __call__(self, *tensors: torch.Tensor) -> Any:
        return self.run(*tensors)

    def upgrade(self) -> None:
        """Compile (on the compile thread, holding the engine's tracing lock) and switch."""
        compile_now, self._compile_now = self._compile_now, None
        if compile_now is None:
            return
        try:
            self._upgrade(compile_now)
        finally:
            self.settled.set()

    def _upgrade(self, compile_now: Callable[[], Callable[..., Any]]) -> None:
        try:
            if self._ahead is not None:
                self._ahead()
            with self._lock:
                self.run = compile_now()
            self.straight_line = False
        except Exception as error:  # the straight-line tier is right, only slower
            (logger.debug if exiting() else logger.warning)(
                "phi_torch_jit: the block of a captured loop stays straight-line: its compile "
                "failed: %s", describe_error(error),
            )  # fmt: skip


_PENDING: list[BackgroundBlock] = []
"""Blocks whose compile is not queued yet."""
_PENDING_LOCK = threading.Lock()


def submit_pending() -> list[BackgroundBlock]:
    """Queue the compiles of the blocks built since the last call (cheap when there are none);
    return those blocks."""
    if not _PENDING:
        return []
    with _PENDING_LOCK:
        blocks = list(_PENDING)
        _PENDING.clear()
    for block in blocks:
        submit(block)  # False at interpreter exit: the block stays straight-line
    return blocks
