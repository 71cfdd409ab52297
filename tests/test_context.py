"""The per-call frame: set by context managers, per thread, always restored."""

from __future__ import annotations

import threading

import pytest

from phi_torch_jit._context import Phase, call_state, current_frame, no_frame
from phi_torch_jit._phases import recording as recording_frame
from phi_torch_jit._phases import tracing
from phi_torch_jit._record import Recording
from phi_torch_jit._replay import ReplayCursor


def test_frames_nest_and_restore() -> None:
    assert current_frame() is None
    with recording_frame("f", Recording()) as outer:
        assert current_frame() is outer and outer is not None and outer.phase is Phase.RECORD
        with no_frame():
            assert current_frame() is None
        with tracing("g", ReplayCursor([], "g"), None, None) as inner:
            assert current_frame() is inner
        assert current_frame() is outer
    assert current_frame() is None


def test_frame_is_restored_after_exception() -> None:
    with pytest.raises(KeyError), recording_frame("f", Recording()):
        raise KeyError("boom")
    assert current_frame() is None


def test_threads_see_their_own_frame() -> None:
    seen: dict[str, object] = {}
    inside = threading.Event()
    release = threading.Event()

    def worker() -> None:
        seen["other thread"] = current_frame()
        inside.set()
        release.wait(5)

    with recording_frame("f", Recording()):
        t = threading.Thread(target=worker)
        t.start()
        inside.wait(5)
        release.set()
        t.join()
    assert seen["other thread"] is None


def test_call_state_is_per_thread() -> None:
    state = call_state()
    state.last_context = "mine"
    seen: list[object] = []
    worker = threading.Thread(target=lambda: seen.append(call_state().last_context))
    worker.start()
    worker.join()
    assert seen == [None] and call_state().last_context == "mine"
    state.last_context = None
