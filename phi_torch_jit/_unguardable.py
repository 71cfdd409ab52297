"""Stage 1 (record): what the function does that no compiled program can repeat.

Noted while the record pass runs, by the patches of :data:`UNGUARDABLE` (an entry of the phase
table, :mod:`._phases`; each wrapper checks that it runs in a record frame of its own thread):

* Python's and NumPy's module-level random functions, ``random.Random`` objects, the clocks of
  :mod:`time` and files opened by user code (a new value on every call), changes of torch's
  RNG state (``torch.manual_seed``...), and draws from a ``torch.Generator`` object
  (``torch.randn(..., generator=g)``: a compiled program would draw from the global RNG
  instead), by any code the function runs;
* grad-mode changes (``torch.no_grad()`` blocks) -- TorchScript's tracer drops them;
* autograd run inside the function by any code it runs: ``loss.backward()`` (an optimizer step
  after it), and ``torch.autograd.grad``, which engines that capture graphs compile
  (:mod:`._inner_grad`) and the others run eagerly;
* ``Tensor.register_hook`` -- a hook on an intermediate tensor is not part of any graph;
* ``torch.func`` transforms and ``Tensor.data``.

A specialization that did any of these runs eagerly, with one JitWarning naming the places
(:func:`._pipeline.specialize`). See NOTE [Python reads] in docs/design.md.
"""

from __future__ import annotations

import functools
import random
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ._context import current_frame
from ._param_writes import REQUIRES_GRAD, before_writes, freezes, note_made, note_used
from ._patches import RefCounted
from ._sources import OWN_DIR, TORCH_DIR, is_user_file
from ._watched_calls import (
    from_anyone,
    from_user,
    note,
    noted_once,
    recording_notes,
    user_line,
    watched_calls,
)

__all__ = ["Unguardable", "UNGUARDABLE", "RecordMode", "generators_watched"]


@dataclass
class Unguardable:
    """What the record pass did that no compiled program repeats (reasons to run eagerly)."""

    random: list[str] = field(default_factory=list)
    """Draws from Python's or NumPy's RNG or a torch.Generator, clock reads, torch RNG state
    changes."""
    grad_mode: list[str] = field(default_factory=list)
    """Places where the grad mode was changed (``no_grad`` / ``enable_grad`` blocks)."""
    saved_hooks: list[str] = field(default_factory=list)
    """Places that entered saved-tensor hooks (``saved_tensors_hooks``; not torch's own)."""
    tensor_hooks: list[str] = field(default_factory=list)
    """Places where ``Tensor.register_hook`` was called."""
    functorch: list[str] = field(default_factory=list)
    """Places where a torch.func transform (vmap, grad...) was applied."""
    data: list[str] = field(default_factory=list)
    """Places where user code reads or writes ``Tensor.data`` (outside autograd's view) or
    calls ``Tensor.as_subclass`` or ``torch.from_dlpack`` (an alias a trace does not follow: it
    bakes it)."""
    autograd: list[str] = field(default_factory=list)
    """Places where ``backward()`` ran inside the function (it writes ``.grad``)."""
    gradients: list[str] = field(default_factory=list)
    """Places where ``torch.autograd.grad`` ran inside the function (captured by engines
    whose ``captures_autograd`` is set, :mod:`._inner_grad`)."""
    per_call_functions: list[str] = field(default_factory=list)
    """``autograd.Function`` classes defined during the call whose code closes over
    tensors or objects holding them (a new class, and new values, on every call)."""
    imports: dict[str, str] = field(default_factory=dict)
    """The user's modules imported while the pass ran -> the line that imported them
    (:mod:`._modules_seen`): not a reason to run eagerly; their data is guarded (``_reads``)."""
    module_reads: dict[tuple[str, str], str] = field(default_factory=dict)
    """(user module, attribute) -> the line that read it, as the pass ran (a module reached by
    a computed name, ``sys.modules[__name__].SCALE``, ``eval`` of built source;
    :mod:`._modules_seen`): guarded like a global (``_reads``)."""
    grad_reads: list[str] = field(default_factory=list)
    """Places where Python read a tensor's ``requires_grad`` (:class:`RecordMode`): not a
    reason to run eagerly; the module guard checks the parameters' ``requires_grad``."""
    layout_reads: LayoutReads = field(default_factory=lambda: LayoutReads())
    """id of each tensor whose layout Python read (``stride()``, ``is_contiguous()``,
    ``shape``, ``dtype``...; :class:`RecordMode`) -> the first place: not a reason to run
    eagerly; the module guard checks the layout of those among the parameters and buffers
    (of all of them where Python read the strides of another tensor: ``LayoutReads``)."""
    type_tests: dict[tuple[type, type], bool] = field(default_factory=dict)
    """(ABC, class) pairs ``isinstance``/``issubclass`` tested (:mod:`._type_tests`) -> the
    answer: not a reason to run eagerly; their answers are guarded (``_reads``)."""
    state_dicts: dict[int, str] = field(default_factory=dict)
    """id of each module whose ``state_dict()`` ran (a child's too) -> where: not a reason to
    run eagerly; which buffers it leaves out and its state-dict hooks are guarded (``_reads``)."""
    grad_state: list[str] = field(default_factory=list)
    """Places where the function read or wrote a tensor's ``.grad`` (``zero_grad``, an
    optimizer's step, ``p.grad = g``) or changed a parameter's ``requires_grad``: state a
    trace would bake, writes a compiled program would not repeat."""
    files: list[str] = field(default_factory=list)
    """Places where user code opened a file (``open``, ``Path.read_text``...): its content
    may change between calls."""
    fast_paths: list[str] = field(default_factory=list)
    """Modules of torch that took their fast path (:mod:`._fast_paths`): fused kernels whose
    values a captured program, which runs the composite path, would not give."""
    loops: list[str] = field(default_factory=list)
    """Places where a PhiML ``while_loop`` ran outside a custom function (values decide its
    iteration count; a trace would repeat a fixed one)."""

    def reasons(
        self, engine: str, keeps_grad_mode: bool, keeps_functorch: bool, captures_autograd: bool
    ) -> list[str]:
        """Why a specialization that did these runs eagerly, one sentence each with its fix
        (for the JitWarning), given what engine ``engine`` keeps."""
        reasons = []
        if self.files:
            reasons.append(
                f"it reads files ({', '.join(self.files[:3])}), whose content a compiled "
                "program would keep from its first call; read them outside the jitted function "
                "and pass the values as arguments"
            )
        if self.random:
            reasons.append(
                f"it draws values a compiled program would repeat ({', '.join(self.random[:3])}); "
                "pass random values and times as tensor arguments, or draw from torch's global RNG "
                "(torch.rand without generator=), which compiled programs draw from"
            )
        if self.grad_mode and not keeps_grad_mode:
            reasons.append(
                f"it changes the grad mode ({', '.join(self.grad_mode[:3])}), which engine "
                f"{engine!r} drops; use engine='compile', which keeps it"
            )
        if self.functorch and not keeps_functorch:
            reasons.append(
                f"it applies torch.func transforms ({', '.join(self.functorch[:3])}), which engine "
                f"{engine!r} does not capture"
            )
        if self.data:
            reasons.append(
                f"it uses Tensor.data, as_subclass or from_dlpack ({', '.join(self.data[:3])}), "
                "aliases made without an op, which traces do not follow (write `with "
                "torch.no_grad(): p.clamp_(...)` instead of .data, compiled by engine 'compile')"
            )
        if self.grad_state:
            reasons.append(
                f"it reads or writes .grad or a parameter's requires_grad "
                f"({', '.join(self.grad_state[:3])}), state a compiled program would keep from "
                "its first call; call zero_grad(), the optimizer and requires_grad_() outside "
                "the jitted function"
            )
        if self.autograd:
            reasons.append(
                f"it runs autograd inside the function ({', '.join(self.autograd[:3])}), which a "
                "compiled program does not repeat faithfully; jit the forward or the loss and call "
                "backward() and the optimizer outside it to have it compiled"
            )
        if self.gradients and not captures_autograd:
            reasons.append(
                f"it runs autograd inside the function ({', '.join(self.gradients[:3])}), which "
                f"engine {engine!r} does not capture; the default engine compiles "
                "torch.autograd.grad inside the function"
            )
        if self.saved_hooks:
            reasons.append(
                f"it enters saved-tensor hooks ({', '.join(self.saved_hooks[:3])}), whose "
                "unpack a compiled program's backward would not call; there is no compiled "
                "form of such a function"
            )
        if self.tensor_hooks:
            reasons.append(
                f"it registers tensor hooks ({', '.join(self.tensor_hooks[:3])}); register them "
                "outside the jitted function"
            )
        if self.per_call_functions:
            reasons.append(
                "it defines autograd.Function classes during the call that close over "
                f"per-call values ({', '.join(self.per_call_functions[:3])}), which a compiled "
                "program would keep from its first call; define the class once, outside the "
                "function, and pass the values to apply() to have it compiled"
            )
        if self.fast_paths:
            reasons.append(
                f"torch takes its fast path ({', '.join(self.fast_paths[:3])}), whose fused "
                "kernels a compiled program would not run (their values differ where a row is "
                "fully masked, or padded); torch.backends.mha.set_fastpath_enabled(False) "
                "before the call has it compiled"
            )
        if self.loops:
            reasons.append(
                f"it runs PhiML while_loops whose iteration count depends on values "
                f"({', '.join(self.loops[:3])}), which a trace would fix; put the loop in a "
                "custom-gradient function (math.solve_linear does) to have it compiled"
            )
        return reasons


class RecordMode(TorchFunctionMode):
    """The record phase's torch-function mode. Entered per record frame (a mode is per thread).

    * A torch call given a ``generator=`` object (``torch.randn(shape, generator=g)``,
      ``x.normal_(generator=g)``, by any code) is noted as a random draw: a compiled program
      cannot hold the generator, it would draw from the global RNG.
    * Python reading a tensor's ``requires_grad`` (``if net.weight.requires_grad:``), by any
      code but torch's, is noted: the path it takes depends on the parameters'
      ``requires_grad``, which the module guard then checks on every call (a change retraces,
      on every engine).
    * Python reading a tensor's layout (``if self.w.is_contiguous():``, ``w.stride()``,
      ``w.shape``, ``w.dtype``), by any code but torch's, is noted with the tensor: where it
      is a parameter or a buffer, the module guard checks its layout on every call
      (``module.to(memory_format=torch.channels_last)`` keeps the parameter objects and
      changes their strides; probe 39c)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if torch.compiler.is_compiling():  # torch.cond's branches, captured by dynamo inside
            return func(*args, **(kwargs or {}))  # the step: it traces through this mode
        before_writes(func, args, kwargs)
        note_used(args, kwargs)
        if kwargs and kwargs.get("generator") is not None:
            name = getattr(func, "__name__", "a torch function")
            note("random", f"a torch.Generator draw ({name}) at {user_line(sys._getframe(1))}")
        elif freezes(func, args):
            note("grad_state", f"Parameter.requires_grad_ at {user_line(sys._getframe(1))}")
        elif getattr(func, "__self__", None) is REQUIRES_GRAD:
            caller = sys._getframe(1)
            if not caller.f_code.co_filename.startswith((TORCH_DIR, OWN_DIR)):
                note("grad_reads", user_line(caller) if from_user(caller) else _at(caller))
        elif args and (func in _LAYOUT_METHODS or getattr(func, "__self__", None) in _LAYOUTS):
            caller = sys._getframe(1)
            if not caller.f_code.co_filename.startswith((TORCH_DIR, OWN_DIR)):
                _note_layout(args[0], caller, func)
        result = func(*args, **(kwargs or {}))
        note_made(args, kwargs, result)
        return result


_LAYOUT_METHODS = frozenset(
    getattr(torch.Tensor, n) for n in ("stride", "is_contiguous", "size", "dim", "numel",
                                       "storage_offset", "__len__")
)  # fmt: skip
_LAYOUTS = frozenset(
    getattr(torch.Tensor, n) for n in ("shape", "dtype", "device", "ndim", "layout", "is_cuda",
                                       "is_sparse")
)  # fmt: skip
"""What reads a tensor's layout: methods, and the descriptors of properties (the mode sees a
property read as its descriptor's ``__get__``)."""


_STRIDE_METHODS = frozenset(
    getattr(torch.Tensor, n) for n in ("stride", "is_contiguous", "storage_offset")
)  # fmt: skip


class LayoutReads(dict[int, str]):
    """id of each tensor whose layout Python read -> the first place; :attr:`strides`, of
    those whose strides it read. An intermediate's strides follow the parameters' (a
    convolution's output is channels-last where its weight is: ``conv.to(memory_format=...)``
    made ``y.is_contiguous()`` answer otherwise, probe 43b): the module guard then checks
    the layout of every parameter and buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.strides: dict[int, str] = {}


def _note_layout(tensor: Any, caller: types.FrameType, func: Any) -> None:
    if (notes := recording_notes()) is not None and isinstance(tensor, torch.Tensor):
        reads = notes.layout_reads
        if id(tensor) not in reads:
            reads[id(tensor)] = user_line(caller) if from_user(caller) else _at(caller)
        strides = getattr(reads, "strides", None)
        if func in _STRIDE_METHODS and strides is not None:
            strides.setdefault(id(tensor), reads[id(tensor)])


def _at(frame: types.FrameType) -> str:
    """``file:line`` of ``frame`` itself (a library's code)."""
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


_MODULE_STATE_DICT = nn.Module.state_dict


@functools.wraps(_MODULE_STATE_DICT)
def _state_dict(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``nn.Module.state_dict``, noting the module in the record pass (made once: see
    ``_WRAPPERS`` in ``_watched_calls``)."""
    if (notes := recording_notes()) is not None:
        notes.state_dicts.setdefault(id(self), user_line(sys._getframe(1)))
    return _MODULE_STATE_DICT(self, *args, **kwargs)


_INHERITED = object()
"""Saved for a method a class inherits (``random.Random.random``, from ``_random.Random``)."""


class _Watch:
    """Installs and removes the wrappers of :func:`watched_calls` (see :data:`UNGUARDABLE`)."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []
        self._properties: list[str] = []

    def install(self) -> None:
        for owner, name, kind, label in watched_calls():
            if isinstance(owner, type):  # a method inherited from a base: deleted after
                original = owner.__dict__.get(name, _INHERITED)
            else:
                original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, noted_once(kind, label, getattr(owner, name)))

        self._saved.append((nn.Module, "state_dict", _MODULE_STATE_DICT))
        nn.Module.state_dict = _state_dict  # type: ignore[assignment,method-assign]
        for name, watched in (("data", _DATA), ("grad", _GRAD)):
            if name not in torch.Tensor.__dict__:  # else someone else's: leave it
                setattr(torch.Tensor, name, watched)
                self._properties.append(name)

    def remove(self) -> None:
        while self._properties:  # back to TensorBase's descriptors
            delattr(torch.Tensor, self._properties.pop())
        while self._saved:
            owner, name, original = self._saved.pop()
            if original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def _note_data(tensor: torch.Tensor) -> None:
    caller = sys._getframe(2)
    if is_user_file(caller.f_code.co_filename):  # torch's own .data uses are fine
        note("data", f"{caller.f_code.co_filename}:{caller.f_lineno}")


_BASE_DATA = torch.Tensor.data  # TensorBase's getset descriptor, inherited


def _get_data(tensor: torch.Tensor) -> torch.Tensor:
    _note_data(tensor)
    return _BASE_DATA.__get__(tensor)  # type: ignore[no-any-return,attr-defined]


def _set_data(tensor: torch.Tensor, value: torch.Tensor) -> None:
    caller = sys._getframe(1)  # torch's code too (vector_to_parameters), called by the user
    if from_anyone(caller):
        note("data", f".data assigned at {user_line(caller)}")
    _BASE_DATA.__set__(tensor, value)  # type: ignore[attr-defined]


_DATA = property(_get_data, _set_data, doc=_BASE_DATA.__doc__)


_BASE_GRAD: Any = torch.Tensor.grad  # TensorBase's getset descriptor, inherited


def _note_grad() -> None:
    caller = sys._getframe(2)
    if from_anyone(caller):  # an optimizer's step is torch's code, called by the user's
        note("grad_state", f".grad at {user_line(caller)}")


def _get_grad(tensor: torch.Tensor) -> torch.Tensor | None:
    _note_grad()
    return _BASE_GRAD.__get__(tensor)  # type: ignore[no-any-return]


def _set_grad(tensor: torch.Tensor, value: torch.Tensor | None) -> None:
    _note_grad()
    _BASE_GRAD.__set__(tensor, value)


def _del_grad(tensor: torch.Tensor) -> None:
    _note_grad()
    _BASE_GRAD.__delete__(tensor)


_GRAD = property(_get_grad, _set_grad, _del_grad, doc=_BASE_GRAD.__doc__)


def _generator_states() -> tuple[Any, ...]:
    """The states of Python's and NumPy's global generators (a few microseconds)."""
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is None:
        return (random.getstate(),)
    name, key, *rest = numpy_random.get_state()
    return random.getstate(), name, key.tobytes(), *rest


@contextmanager
def generators_watched() -> Iterator[None]:
    """Note a draw from Python's or NumPy's global generator during the record pass however
    it was reached: through a name bound before the watch's patches (a library's
    ``from random import shuffle``), by a library's code, or by the user's."""
    before = _generator_states()
    yield
    if _generator_states() != before:
        frame = current_frame()
        if frame is not None and frame.recording is not None:
            if not frame.recording.unguardable.random:  # else named where it happened
                note("random", "a draw from Python's or NumPy's global generator")


_WATCH = _Watch()
UNGUARDABLE = RefCounted(_WATCH.install, _WATCH.remove)
"""The record phase's patch: unguardable calls from user code are noted in the recording."""
