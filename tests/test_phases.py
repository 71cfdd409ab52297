"""The patch table: what each phase installs, process-wide, and that it all goes away."""

from __future__ import annotations

import abc
import builtins
import importlib
import sys
import threading
import types
import warnings

import pytest
import torch
from torch import nn

from phi_torch_jit._context import Phase, current_frame
from phi_torch_jit._custom_op import NestedCalls
from phi_torch_jit._function import interception_installed
from phi_torch_jit._libraries import LibraryPasses
from phi_torch_jit._phases import MODULE_HOOK, PATCHES, compiling, recording, tracing
from phi_torch_jit._record import Recording
from phi_torch_jit._replay import ReplayCursor
from phi_torch_jit._warnings import TORCHSCRIPT_NOTICE
from phi_torch_jit.adapters.phiml import PhiMLBridge
from phi_torch_jit.engines import get_engine


def _active() -> dict[str, bool]:
    """Which process-wide patches are in force now."""
    return {
        "module hook": MODULE_HOOK.handle_id is not None,
        "print": builtins.print is not _ORIGINAL_PRINT,
        "Function.apply": interception_installed(),
        "conversions": "__bool__" in torch.Tensor.__dict__,
        "notices": any(f[1] is not None and f[1].pattern == TORCHSCRIPT_NOTICE
                       for f in warnings.filters),
        "imports": builtins.__import__ is not _ORIGINAL_IMPORT
                   or importlib.import_module is not _ORIGINAL_IMPORT_MODULE
                   or builtins.eval is not _ORIGINAL_EVAL
                   or type(sys.modules[__name__]) is not types.ModuleType,
        "fast paths": torch.overrides.has_torch_function is not _ORIGINAL_CHECK,
        "type tests": vars(abc.ABCMeta)["__instancecheck__"] is not _ORIGINAL_INSTANCECHECK,
    }  # fmt: skip


_ORIGINAL_PRINT = builtins.print
_ORIGINAL_IMPORT, _ORIGINAL_IMPORT_MODULE = builtins.__import__, importlib.import_module
_ORIGINAL_EVAL = builtins.eval
_ORIGINAL_CHECK = torch.overrides.has_torch_function
_ORIGINAL_INSTANCECHECK = vars(abc.ABCMeta)["__instancecheck__"]
_NONE = dict.fromkeys(
    (
        "module hook",
        "print",
        "Function.apply",
        "conversions",
        "notices",
        "imports",
        "fast paths",
        "type tests",
    ),
    False,
)


def test_the_table_names_each_patch_once_with_its_phases() -> None:
    names = [p.name for p in PATCHES]
    assert len(set(names)) == len(names) == 12
    assert all(p.phases and p.phases <= set(Phase) for p in PATCHES)


def test_record_phase_installs_its_patches_and_removes_them() -> None:
    assert _active() == _NONE
    with recording("f", Recording()) as frame:
        assert current_frame() is frame and frame.phase is Phase.RECORD
        assert _active() == {**_NONE, "module hook": True, "print": True,
                             "Function.apply": True, "notices": True, "imports": True,
                             "fast paths": True, "type tests": True}  # fmt: skip
    assert _active() == _NONE and current_frame() is None


@pytest.mark.parametrize("guarding", [True, False])
def test_trace_phase_patches_conversions_only_when_guarding(guarding: bool) -> None:
    with tracing("f", ReplayCursor([], "f"), [] if guarding else None, None):
        assert _active() == {**_NONE, "Function.apply": True, "notices": True, "print": True,
                             "conversions": guarding}  # fmt: skip
    assert _active() == _NONE


def test_compile_phase_captures_functions_and_hides_notices() -> None:
    with compiling("f", NestedCalls(get_engine("torchscript"))):
        assert _active() == {**_NONE, "Function.apply": True, "notices": True}
    assert _active() == _NONE


def test_phiml_bridge_is_on_phimls_jit_stack_in_record_and_trace() -> None:
    backend = pytest.importorskip("phiml.backend.torch._torch_backend")
    passes = LibraryPasses()  # the registered libraries' hooks: PhiML's adapter's included
    (bridge,) = [h for h in passes.hooks if isinstance(h, PhiMLBridge)]
    with recording("f", Recording(libraries=passes)):
        assert backend.CURRENT_JIT_CALLS[-1] is bridge
    with tracing("f", ReplayCursor([], "f"), None, passes):
        assert backend.CURRENT_JIT_CALLS[-1] is bridge
    assert bridge not in backend.CURRENT_JIT_CALLS


def test_patches_are_removed_after_an_exception() -> None:
    with pytest.raises(ValueError), recording("f", Recording()):
        raise ValueError("user error")
    assert _active() == _NONE and current_frame() is None


def test_patches_stay_while_another_thread_still_needs_them() -> None:
    inside, release = threading.Event(), threading.Event()
    seen: list[dict[str, bool]] = []

    def other() -> None:
        with recording("g", Recording()):
            inside.set()
            release.wait(5)

    worker = threading.Thread(target=other)
    worker.start()
    inside.wait(5)
    with recording("f", Recording()):
        pass
    seen.append(_active())  # this thread left; the other is still recording
    assert current_frame() is None  # frames are per thread
    release.set()
    worker.join()
    assert seen[0]["module hook"] and seen[0]["Function.apply"]
    assert _active() == _NONE


def test_module_hook_records_modules_only_in_record_frames() -> None:
    net = nn.Linear(2, 2)
    rec = Recording()
    with recording("f", rec):
        net(torch.ones(2))
        done = threading.Thread(target=lambda: nn.Linear(2, 2)(torch.ones(2)))
        done.start()
        done.join()  # another thread's module call is not ours
    assert list(rec.modules.values()) == [net]


def test_imports_note_the_users_modules_only_in_record_frames() -> None:
    """``_modules_seen``: a user's module imported in the record pass, by ``import`` or by
    ``importlib``, is noted with the line that imported it; a library's module is not, nor
    an import of another thread or outside the pass."""
    rec = Recording()
    with recording("f", rec):
        importlib.import_module("read_settings")
        import json  # a standard library module  # noqa: F401

        other = threading.Thread(target=lambda: importlib.import_module("helpers"))
        other.start()
        other.join()
    importlib.import_module("test_phases")
    assert list(rec.unguardable.imports) == ["read_settings"]
    assert rec.unguardable.imports["read_settings"].startswith(__file__)


SCALE, OFFSET, UNREAD = 2.0, 1.0, 3.0


def _reads_by_computed_names() -> tuple[float, str, float, float]:
    own = sys.modules[__name__]
    name = "OFF" + "SET"
    return own.SCALE, own.__name__, vars(own)["SCALE"], eval(name + " * 2")


def test_reads_of_a_users_module_are_noted_by_name_only_in_record_frames() -> None:
    """``_modules_seen``: while the record pass runs, attribute reads of a user module
    (``sys.modules[__name__].SCALE``), the constants a ``vars(module)[...]`` names and the
    globals that source evaluated at run time loads are noted with their lines; dunders,
    another thread's reads and reads outside the pass are not. The module's class and
    ``eval`` are put back after."""
    rec = Recording()
    with recording("f", rec):
        assert _reads_by_computed_names() == (2.0, __name__, 2.0, 2.0)
        other = threading.Thread(target=lambda: sys.modules[__name__].UNREAD)
        other.start()
        other.join()
    assert sys.modules[__name__].UNREAD == 3.0
    assert sorted(rec.unguardable.module_reads) == [(__name__, "OFFSET"), (__name__, "SCALE")]
    assert all(w.startswith(__file__) for w in rec.unguardable.module_reads.values())
    assert type(sys.modules[__name__]) is types.ModuleType and builtins.eval is _ORIGINAL_EVAL


def test_eval_and_exec_in_the_record_pass_run_in_their_callers_namespaces() -> None:
    """The watching ``eval``/``exec`` stand in for the builtins: without globals they see the
    caller's globals and locals, as the builtins do."""
    local = 5.0  # noqa: F841 (read by the evaluated source)
    found: dict[str, float] = {}
    with recording("f", Recording()):
        assert eval("local + SCALE") == 7.0
        exec("found['k'] = local * OFFSET")
        assert eval("x + 1", {"x": 1}) == 2
    assert found == {"k": 5.0}
