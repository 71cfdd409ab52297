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
from typing import Any

import torch

__all__ = ["RefCounted", "TensorAttributes"]


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

    def acquire(self) -> None:
        """Start using the patch (installs it for the first user); pair with :meth:`release`."""
        with self._lock:
            if self._users == 0:
                self._install()
            self._users += 1

    def release(self) -> None:
        """Stop using the patch (removes it after the last user)."""
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self._remove()

    @contextmanager
    def active(self) -> Iterator[None]:
        """Use the patch while the block runs."""
        self.acquire()
        try:
            yield
        finally:
            self.release()


class TensorAttributes:
    """Attributes of ``torch.Tensor`` replaced while installed; what the class itself defined
    under each name is put back on removal, and a name it only inherited is deleted again."""

    def __init__(self, names: tuple[str, ...], make: Callable[[str], Any]) -> None:
        self.names = names
        self._make = make
        self._saved: dict[str, Any] = {}

    def install(self) -> None:
        for name in self.names:
            self._saved[name] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, self._make(name))

    def remove(self) -> None:
        for name in self.names:
            saved = self._saved.pop(name)
            if saved is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, saved)
