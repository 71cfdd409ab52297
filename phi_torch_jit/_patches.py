"""Process-wide patches that exist only while at least one thread needs them.

Several stages change process-wide state for the duration of a pass: a global
module pre-hook (record), ``torch.autograd.Function.apply`` (record, trace,
compile), the tensor-to-Python conversions (trace) and ``print`` (record).
Each patched function checks the current frame and passes other threads'
calls straight through; :class:`RefCounted` installs a patch when the first
user enters and removes it when the last one leaves, under a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["RefCounted"]


class RefCounted:
    """Install on first use, remove after last use; safe across threads."""

    def __init__(self, install: Callable[[], None], remove: Callable[[], None]) -> None:
        self._install = install
        self._remove = remove
        self._lock = threading.Lock()
        self._users = 0

    @property
    def installed(self) -> bool:
        """Whether some thread is using the patch now."""
        return self._users > 0

    @contextmanager
    def active(self) -> Iterator[None]:
        """Use the patch while the block runs."""
        with self._lock:
            if self._users == 0:
                self._install()
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    self._remove()
