"""The record phase's watch on tensors the step writes (see :mod:`._unguardable`, whose
torch-function mode calls it for every torch call of the record pass).

A tensor that existed before the pass and is written in place inside the step (a parameter:
``p.add_(...)`` under ``no_grad``, ``p[i] = v``, a foreach update, ``out=p``; a buffer of a
module the step does not call; a global or closure tensor) is noted *before* the write, its
value kept (``StateSnapshot.before_write``): the trace is rewound past the write, as the
buffers of called modules are, and does not write it a second time (it did: twice per call on
the default engine, three times on "compile", with the warm-up run). Tensors the pass made
(:func:`note_made`) are left alone; the tensors its torch calls are given are noted too
(:func:`note_used`). A parameter whose ``requires_grad`` the step changes is a
reason to run eagerly (:func:`freezes`).
"""

from __future__ import annotations

from typing import Any

import torch

from ._compat import is_view, storage_pointer, view_base
from ._context import CustomBody, Phase, Recorder, current_frame, custom_body

__all__ = ["before_writes", "note_made", "note_used", "freezes", "IN_PLACE_DUNDERS",
           "REQUIRES_GRAD"]  # fmt: skip

REQUIRES_GRAD = torch.Tensor.requires_grad
"""The attribute's descriptor: a read reaches a torch-function mode as a call of its
``__get__``, a write as its ``__set__``."""


def before_writes(func: Any, args: tuple[Any, ...], kwargs: Any) -> None:
    """Tensors ``func`` writes in place (``p.add_``, ``p[i] = v``, ``p += v``, a foreach op,
    ``out=p``), directly or through a view (``w[0].mul_(2)``), are noted before the write
    unless the pass made them: parameters, buffers (of modules the step calls or not), global
    and closure tensors. The trace is rewound past the write."""
    name = getattr(func, "__name__", "")
    if name == "numpy" and args and isinstance(args[0], torch.Tensor):
        _lent_to_numpy(args[0])
        return
    in_place = (name.endswith("_") and not name.endswith("__")) or name in IN_PLACE_DUNDERS
    targets = list(args[:1]) if in_place else []
    if targets and isinstance(targets[0], (list, tuple)):  # torch._foreach_add_(params, ...)
        targets = list(targets[0])
    if kwargs and kwargs.get("out") is not None:
        out = kwargs["out"]
        targets += list(out) if isinstance(out, (list, tuple)) else [out]
    if not targets:
        return
    frame = current_frame()
    body = custom_body() if frame is None else None
    if body is not None:  # a custom function's body: its own inputs and what it makes only
        _body_writes(body, targets)
        return
    if frame is None or frame.phase is not Phase.RECORD or frame.recording is None:
        return
    made, aliases = frame.recording.made, frame.recording.aliases
    for target in targets:
        written = _written(target, aliases)
        if written is not None and id(written) not in made:
            frame.recording.before_write(written)


def _lent_to_numpy(tensor: torch.Tensor) -> None:
    """``t.numpy()`` of a tensor the record pass did not make: NumPy may write it where no
    torch call sees it (``n = a.numpy(); n += 1``); its value is kept to compare after the
    pass (``StateSnapshot.written_unseen``)."""
    frame = current_frame()
    if frame is None or frame.phase is not Phase.RECORD or frame.recording is None:
        return
    written = _written(tensor, frame.recording.aliases)
    if written is not None and id(written) not in frame.recording.made:
        frame.recording.lent_to_numpy(written)


def _written(target: Any, aliases: dict[int, torch.Tensor]) -> torch.Tensor | None:
    """The tensor an in-place write to ``target`` writes: itself, the tensor it views
    (``w[0].mul_(2)`` writes ``w``), or the tensor it is an alias of (``p.data``,
    ``p.detach()``: :func:`note_made`)."""
    if not isinstance(target, torch.Tensor):
        return None
    base = None if isinstance(target, torch.nn.Parameter) else view_base(target)
    written = target if base is None else base
    return aliases.get(id(written), written)


def _body_writes(body: CustomBody, targets: list[Any]) -> None:
    """A custom function's forward (or gradient) writing a tensor it was not given and did not
    make (a global counter, a module's buffer): its compiled forward would not repeat the
    write faithfully (a captured graph drops it; the compile step runs it once more), so the
    step runs eagerly."""
    made, aliases = body.recording.made, body.recording.aliases
    for target in targets:
        written = _written(target, aliases)
        through_alias = isinstance(target, torch.Tensor) and id(target) in aliases  # s.data
        if written is None or id(written) in made:
            continue
        if id(written) in body.inputs and not through_alias:  # its own input: as eagerly
            continue
        if target is not written and id(target) in body.inputs and not through_alias:
            continue  # a view of an input
        reason = (
            f"the custom function {body.label} writes a tensor in place that it is not given "
            "(a global or a module's buffer) or writes one through .data, which its compiled "
            "forward would not repeat faithfully; pass the tensor to it as an argument and "
            "write it directly to have it compiled"
        )
        if reason not in body.recording.eager_reasons:
            body.recording.eager_reasons.append(reason)


def note_made(args: tuple[Any, ...], kwargs: Any, result: Any) -> None:
    """Note the tensors a torch call of the record pass made (not one of its inputs, as an
    in-place op or ``x.to(x.dtype)`` returns): written in place later, they need no
    rewinding. An alias of an input that is no view (``p.data``, ``p.detach()``) is noted as
    that input's alias: a write to it writes the input. A tensor made otherwise is rewound
    needlessly, never missed."""
    if isinstance(result, torch.Tensor):
        outputs: Any = (result,)
    elif isinstance(result, (tuple, list)):
        outputs = result
    else:
        return
    recording = _recording()
    if recording is None:
        return
    given = [
        a for a in (*args, *(kwargs.values() if kwargs else ())) if isinstance(a, torch.Tensor)
    ]
    inputs = {id(a) for a in given}
    storages: dict[int, torch.Tensor] | None = None
    for output in outputs:
        if not isinstance(output, torch.Tensor) or id(output) in inputs:
            continue
        if given and not is_view(output):
            storages = _storages(given) if storages is None else storages
            source = storages.get(storage_pointer(output))
            if source is not None:  # p.data, p.detach()
                recording.aliases[id(output)] = recording.aliases.get(id(source), source)
                continue
        recording.made.add(id(output))
        recording.aliases.pop(id(output), None)  # an alias freed, its id taken by this one


def _recording() -> Recorder | None:
    """The recording of the record pass (or of the custom body it runs) on this thread."""
    frame = current_frame()
    body = custom_body() if frame is None else None
    if body is not None:
        return body.recording
    if frame is None or frame.phase is not Phase.RECORD:
        return None
    return frame.recording


def note_used(args: tuple[Any, ...], kwargs: Any) -> None:
    """Note the tensors a torch call of the record pass is given (in lists and tuples too, as
    ``torch.cat`` and the foreach ops take them): a global or closure tensor that no call of
    the pass is given, nor a property of it read, plays no part in the program."""
    recording = _recording()
    if recording is None:
        return
    used = recording.used
    for value in (*args, *(kwargs.values() if kwargs else ())):
        if isinstance(value, torch.Tensor):
            used.add(id(value))
        elif isinstance(value, (list, tuple)):
            _note_items(used, value, 3)


def _note_items(used: set[int], values: list[Any] | tuple[Any, ...], depth: int) -> None:
    for value in values:
        if isinstance(value, torch.Tensor):
            used.add(id(value))
        elif depth and isinstance(value, (list, tuple)):
            _note_items(used, value, depth - 1)


def _storages(tensors: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    found = {storage_pointer(t): t for t in reversed(tensors)}  # the first of each storage
    found.pop(0, None)
    return found


IN_PLACE_DUNDERS = frozenset(
    ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
     "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
     "__imatmul__")
)  # fmt: skip
"""Tensor methods that write their tensor (``p[i] = v``, ``p += v``)."""


def freezes(func: Any, args: tuple[Any, ...]) -> bool:
    """``p.requires_grad_(...)`` or ``p.requires_grad = ...`` on a parameter."""
    setter = getattr(func, "__self__", None) is REQUIRES_GRAD and func.__name__ == "__set__"
    named = getattr(func, "__name__", "") == "requires_grad_"
    return (setter or named) and bool(args) and isinstance(args[0], torch.nn.Parameter)
