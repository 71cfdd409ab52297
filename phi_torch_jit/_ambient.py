"""Stage 0, the ambient part of the cache key: the torch state around a call that its program
bakes in (autocast, the default dtype and device, torch-function modes, a registered
library's settings, torch's global switches), how it reads in ``explain()``, and which of it
makes the calls run eagerly (saved-tensor hooks, ``parametrize.cached()``, modes of yours,
a tensor subclass with a ``__torch_function__`` of its own among the inputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from ._compat import any_autocast, function_mode_at, function_modes, top_saved_tensor_hooks
from .extend import REGISTERED

__all__ = [
    "ambient_state",
    "eager_around",
    "modes_around",
    "overrides_torch_function",
    "describe_ambient",
]

_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps")


def ambient_state() -> Any:
    """The torch state around a call that its program bakes in, as part of a cache key: None
    (no autocast, default dtype float32, no torch-function mode: one C call each), or a tuple
    of ``(device, dtype)`` for each device where autocast is on, ``("default dtype", dtype)``
    where ``torch.set_default_dtype`` changed it and ``("default device", device)`` where
    ``torch.set_default_device`` (or ``with torch.device(...)``) made another device than the
    CPU the default (``torch.ones(3)`` in the step makes that dtype, on that device), and
    ``("function modes", classes)`` where torch-function modes of the user's are active
    around the call (``with MyMode():``): such a call runs eagerly (:func:`modes_around`),
    and ``("PhiML settings", pairs)`` for a registered library's settings
    (``extend.Library.ambient``: PhiML's precision), and ``("torch flags", bits)`` where
    inference mode or deterministic algorithms are on (:func:`_flags`:
    grad mode is off in ``torch.inference_mode()`` too, as under ``no_grad``, but tensors it
    makes are inference tensors and ``torch.is_inference_mode_enabled()`` reads True)."""
    dtype = torch.get_default_dtype()
    modes = function_modes()
    settings = tuple(
        (f"{library.name} settings", value)
        for library in REGISTERED
        if (value := library.ambient()) is not None
    )
    flags = _flags()  # inference mode, deterministic algorithms
    if dtype is torch.float32 and not modes and not settings and not any_autocast() and not flags:
        return None
    state: tuple[Any, ...] = tuple(
        (device, torch.get_autocast_dtype(device))
        for device in _AUTOCAST_DEVICES
        if torch.is_autocast_enabled(device)
    )
    if flags:
        state = (*state, ("torch flags", flags))
    if dtype is not torch.float32:
        state = (*state, ("default dtype", dtype))
    default = torch.get_default_device() if modes else None
    if default is not None and default.type != "cpu":
        state = (*state, ("default device", default))
    foreign = tuple(type(function_mode_at(i)) for i in range(modes)) if modes else ()
    foreign = tuple(k for k in foreign if not k.__module__.startswith(_OWN_MODES))
    if foreign:
        state = (*state, (_MODES, foreign))
    return (*state, *settings) or None


def _flags() -> int:
    """Torch's global switches that the traced Python may branch on, as bits (0 when all are
    off): inference mode (``no_grad``'s key otherwise), deterministic algorithms, saved-tensor
    hooks and ``parametrize.cached()`` around the call (:func:`eager_around`). Not anomaly
    detection: AOTAutograd switches it on, process-wide, while it captures a graph, and a call
    on another thread then took another key (a retrace)."""
    flags = torch.is_inference_mode_enabled() | torch.are_deterministic_algorithms_enabled() << 1
    flags |= _CACHED_PARAMETRIZATIONS * bool(parametrize._cache_enabled)  # (probe 39c)
    return flags | _SAVED_HOOKS * (top_saved_tensor_hooks(False) is not None)


_SAVED_HOOKS, _CACHED_PARAMETRIZATIONS = 4, 8  # bits of _flags: the call runs eagerly
_EAGER_AROUND = {
    _SAVED_HOOKS: "saved-tensor hooks are active around the call (saved_tensors_hooks, "
    "save_on_cpu): a compiled backward would not call them",
    _CACHED_PARAMETRIZATIONS: "torch.nn.utils.parametrize.cached() is active around the "
    "call: eager code reuses the parametrized weights cached in it, a compiled program "
    "would compute them anew",
}
_MODES = "function modes"
_OWN_MODES = ("torch.", "phi_torch_jit.")
"""Modes of torch (``with torch.device(...)``, a trace's own) and of ours (the record pass's)."""


def eager_around(state: Any) -> str:
    """Why the ambient ``state`` of a key makes its calls run eagerly ("": it does not)."""
    flags = next((t for d, t in state or () if d == "torch flags"), 0)
    return "; ".join(reason for bit, reason in _EAGER_AROUND.items() if flags & bit)


def modes_around(state: Any) -> str:
    """The torch-function modes of the user's that were active around the calls of a key
    (names, comma-separated), or "": their ``__torch_function__`` is Python that runs around
    every op, which a captured program would not run (a program traced under one bakes what
    it did then)."""
    found = [t for d, t in state or () if d == _MODES]
    return ", ".join(k.__qualname__ for k in found[0]) if found else ""


def describe_ambient(state: Any) -> str:
    """``"autocast cuda float16, default dtype float64, default device cuda:0"``, or
    ``"none"``."""
    return ", ".join(_described(d, t) for d, t in state) if state else "none"


def _described(what: str, value: Any) -> str:
    if what == _MODES:
        return f"torch-function modes {', '.join(k.__qualname__ for k in value)}"
    if what.endswith(" settings"):  # a library's: "PhiML precision 64, default backend torch"
        return f"{what.removesuffix(' settings')} " + ", ".join(f"{k} {v}" for k, v in value)
    text = str(value).replace("torch.", "")
    return f"{what} {text}" if what in _DEFAULTS else f"autocast {what} {text}"


_DEFAULTS = ("default dtype", "default device")


def overrides_torch_function(tensors: Sequence[torch.Tensor]) -> str:
    """Why a tensor subclass among the inputs makes the call run eagerly: its own
    ``__torch_function__`` is Python that runs around every op on it (a capture would keep
    the ops and lose what it adds); empty if none does (``nn.Parameter`` has none)."""
    for tensor in tensors:
        klass = type(tensor)
        if klass is torch.Tensor:
            continue
        function = getattr(klass.__torch_function__, "__func__", klass.__torch_function__)
        if function not in _PLAIN_TORCH_FUNCTIONS:
            return (f"a tensor of class {klass.__qualname__} has a __torch_function__ of its own, "
                    "which a captured program would not run")  # fmt: skip
    return ""


_PLAIN_TORCH_FUNCTIONS = tuple(
    getattr(klass.__torch_function__, "__func__", klass.__torch_function__)
    for klass in (torch.Tensor, nn.Parameter)  # a parameter's: disabled
)
