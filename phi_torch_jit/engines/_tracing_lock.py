"""The tracing lock: one thread traces FX graphs at a time, and a compile lends it while the C++
compiler builds its program.

Two FX traces at once crash torch 2.13 (NOTE [one tracing thread] in docs/design.md), so every
capture and every backend compile of the package holds :data:`~._capture.CAPTURE_LOCK`. Engine
"auto"'s compile thread holds it for a whole compile (10-40 s for inductor on a cold cache);
about half of that time is inductor's C++ compiler running in a subprocess, during which the
compile thread traces nothing. This lock lets a caller capture in that window:

* **Holders** take it like a plain lock (:meth:`acquire`, ``with``; the compile thread, a
  compile on the caller's thread, a block's or a custom body's capture).
* **Sessions** reserve it for a whole specialization (record pass, custom bodies, loop
  blocks, the wrapper's capture): :meth:`session` never waits, and returns None when the lock
  is taken. Inside a session, the session's thread takes the lock as a holder would (one
  acquisition at a time, as before); a holder that waits (the compile thread) waits for the
  session's end, so a compile cannot start between two of the specialization's captures.
  Another thread's *try* (``acquire(blocking=False)``) still succeeds while the session's
  thread holds nothing, as before sessions existed (autograd's device thread running a
  custom backward inside a record pass).
* **Lending**: a holder that is not in a session lends the lock around a C++ build
  (:meth:`lent`, called by the build hook of ``_compat``). Meanwhile one session may start; it
  is *borrowed* (:meth:`borrowed_here`), and a backend compile inside it raises ``NotNow``
  (inductor's settings are process-wide: a compile nested in a paused compile would run with
  the paused one's). After the build, the holder waits for the session to end, and no new
  session starts meanwhile.

Plain acquisitions never borrow: only a session, whose pipeline turns a ``NotNow`` into an
eager call, runs in a lent window.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from .._compat import fx_patches_per_thread
from .._patches import RefCounted

__all__ = ["TracingLock", "note_busy"]

_FX_ON_HOLDER = RefCounted(*fx_patches_per_thread())
"""While any thread holds a tracing lock, FX's tracer patches ``nn.Module.__call__`` and
``__getattr__`` for its own thread only: the caller's eager modules, run on another thread
during a background compile, raised NameError through the tracer's wrapper."""

_logger = logging.getLogger("phi_torch_jit")


class TracingLock:
    """A lock for FX tracing with whole-specialization sessions and lending during builds."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._holder: int | None = None
        """The thread that acquired it."""
        self._session: int | None = None
        """The thread whose session reserves it."""
        self._depth = 0
        """Nested sessions of that thread."""
        self._lender: int | None = None
        """The holder that lent it during a build; its hold resumes after."""
        self._reclaiming = False
        """The lender's build is done: no new session starts."""
        self.borrowed = 0
        """Sessions that ran in a lent window (for tests)."""

    # The plain-lock protocol (threading.Lock's), for holders.

    def acquire(self, blocking: bool = True) -> bool:
        """Take the lock as a holder: free, or reserved by this thread's session. A blocking
        call waits while another thread holds it, reserves it, or lent it."""
        me = threading.get_ident()
        with self._cond:
            if self._holder == me:
                if blocking:
                    raise RuntimeError("phi_torch_jit: the tracing lock is not reentrant")
                return False
            if blocking:
                self._cond.wait_for(lambda: self._free_for(me))
            elif not self._free_for(me, trying=True):
                return False
            self._holder = me
        _FX_ON_HOLDER.acquire()
        return True

    def release(self) -> None:
        with self._cond:
            if self._holder != threading.get_ident():
                raise RuntimeError("phi_torch_jit: the tracing lock is released by a non-holder")
            self._holder = None
            self._cond.notify_all()
        _FX_ON_HOLDER.release()

    def __enter__(self) -> TracingLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def locked(self) -> bool:
        """Whether a session could not start now on a thread without one."""
        with self._cond:
            return self._holder is not None or self._session is not None or self._reclaiming

    def _free_for(self, me: int, trying: bool = False) -> bool:
        """Whether ``me`` may take the lock now: not while another thread holds it or lent
        it; a session keeps out waiting holders (the compile thread), and lets a try through
        while its thread holds nothing (as before sessions: a custom backward run by
        autograd's device thread in a record pass)."""
        if self._holder is not None:
            return False
        if self._session == me:
            return True
        if self._lender is not None or self._reclaiming:
            return False
        return self._session is None or trying

    # Sessions, for a whole specialization on a caller's thread.

    def session(self) -> _Session | None:
        """Reserve the lock for this thread until the returned context exits; None (at once)
        if another thread holds or reserves it, or a build's lender is taking it back.
        Reentrant: a session inside this thread's session is the same session."""
        me = threading.get_ident()
        with self._cond:
            if self._session == me:
                self._depth += 1
            elif self._holder is None and self._session is None and not self._reclaiming:
                self._session, self._depth = me, 1
                if self._lender is not None:
                    self.borrowed += 1
            else:
                return None
        return _Session(self)

    def _end_session(self) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._session = None
                self._cond.notify_all()

    def reserved_here(self) -> bool:
        """Whether this thread is in a session (waiting for a compile here would wait forever:
        the compile thread waits for the session)."""
        with self._cond:
            return self._session == threading.get_ident()

    def borrowed_here(self) -> bool:
        """Whether this thread's session runs while a holder lent the lock (a backend compile
        must not start here: ``NotNow``)."""
        with self._cond:
            return self._lender is not None and self._session == threading.get_ident()

    # Lending, for a holder waiting on a subprocess.

    @contextmanager
    def lent(self) -> Iterator[None]:
        """Around work of the holder that touches no tracing state (a C++ build): one session
        may run meanwhile; on exit the holder waits for it to end and holds the lock again. A
        thread that is not the plain holder (a session's own compile) lends nothing."""
        me = threading.get_ident()
        with self._cond:
            lending = self._holder == me and self._session is None and self._lender is None
            if lending:
                self._holder, self._lender = None, me
                self._cond.notify_all()
        try:
            yield
        finally:
            if lending:
                with self._cond:
                    self._reclaiming = True
                    try:
                        self._cond.wait_for(lambda: self._holder is None and self._session is None)
                    finally:  # held again even if interrupted (Ctrl-C on a caller's compile)
                        self._holder, self._lender, self._reclaiming = me, None, False


class _Session:
    """The context of :meth:`TracingLock.session`."""

    def __init__(self, lock: TracingLock) -> None:
        self._lock = lock

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self._lock._end_session()


_BUSY_NOTED: set[str] = set()


def note_busy(owner: str) -> None:
    """Logged once per function: its new signature runs eagerly while a compile runs."""
    if owner not in _BUSY_NOTED:
        _BUSY_NOTED.add(owner)
        _logger.info(
            "phi_torch_jit: %s: a new signature runs eagerly until the background compile "
            "of another one has finished (one thread traces at a time)", owner,
        )  # fmt: skip
