"""Tracing engines behind one small interface.

An engine turns two kinds of targets into callables:

* :meth:`Engine.compile_function` -- a *flat* function (tensors in, tuple of
  tensors out): the forward of a recorded custom function, or one
  needs-input-grad specialization of its backward. The engine may decline to
  trace faithfully and say so (mode ``"scripted"`` or ``"python"``), which is
  how data-dependent loops avoid being baked in.
* :meth:`Engine.compile_module` -- the synthesized wrapper module, whose
  forward replays the user function on flat tensors.

Engines are registered by name (:func:`register_engine`) and looked up with
:func:`get_engine`; those are the only ways to reach the registry. Built in: ``"auto"`` (the
default: the captured graph at once, the backend's compile of it from a background thread
when ready; no TorchScript), ``"compile"`` (torch.compile's backends, any of them),
``"eager"`` (nothing compiled) and ``"torchscript"`` (legacy: TorchScript is deprecated).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import ConfigurationError, UsageError
from ._background import wait_idle
from ._capture import CAPTURE_LOCK
from .auto import AutoEngine
from .base import (
    RANDOM_OPS,
    CompiledFunction,
    CompiledModule,
    Engine,
    FunctionTarget,
    Mode,
    captured_tensor_message,
)
from .compile import CompileEngine
from .eager import EagerEngine
from .torchscript import TorchScriptEngine

__all__ = [
    "Engine",
    "FunctionTarget",
    "CompiledFunction",
    "CompiledModule",
    "Mode",
    "RANDOM_OPS",
    "captured_tensor_message",
    "register_engine",
    "get_engine",
    "available_engines",
    "wait_all_compiled",
]


_REGISTRY: dict[str, Callable[[], Engine]] = {}


def wait_all_compiled(timeout: float | None = None) -> bool:
    """Wait until the compile thread has finished every compile queued so far (of any jitted
    function); False if ``timeout`` seconds passed first, and at once inside a jitted
    function's specialization (the compile thread waits for it to end)."""
    if timeout is not None and (type(timeout) is bool or not isinstance(timeout, (int, float))):
        raise UsageError(  # ptj.wait_compiled(step): two probes wrote it (40a, 40c)
            f"wait_compiled(timeout) takes seconds or None, not a {type(timeout).__name__}: it "
            "waits for every jitted function; to wait for one, call its own .wait_compiled()"
        )
    if timeout is not None and timeout < 0:
        raise UsageError(f"wait_compiled: timeout must be None or >= 0 seconds, got {timeout}")
    if CAPTURE_LOCK.reserved_here():
        return False
    return wait_idle(timeout)


def register_engine(name: str, factory: Callable[[], Engine]) -> None:
    """Make ``jit(engine=name)`` use engines made by ``factory``."""
    _REGISTRY[name] = factory


def available_engines() -> tuple[str, ...]:
    """Names accepted by ``jit(engine=...)``."""
    return tuple(sorted(_REGISTRY))


def get_engine(engine: str | Engine, options: Mapping[str, Any] | None = None) -> Engine:
    """Resolve an engine name (or pass an Engine instance through).

    ``options`` are passed to the engine's factory, e.g. ``{"backend": "inductor"}`` for
    ``"compile"``.

    Raises:
        ConfigurationError: (a ValueError) unknown name; the message lists the accepted names.
        UsageError: (a TypeError) options for an Engine instance, or options its factory does
            not take.
    """
    options = dict(options or {})
    if isinstance(engine, Engine):
        if options:
            raise UsageError(
                f"phi_torch_jit: options {sorted(options)} were given with an Engine instance; "
                "pass them to the engine's constructor instead."
            )
        return engine
    try:
        factory = _REGISTRY[engine]
    except (KeyError, TypeError):
        raise ConfigurationError(
            f"phi_torch_jit: unknown engine {engine!r}; use one of {available_engines()} "
            "or an Engine instance."
        ) from None
    if not options:
        return factory()
    try:
        signature = inspect.signature(factory)
        signature.bind(**options)
    except (TypeError, ValueError):
        raise UsageError(
            f"phi_torch_jit: engine {engine!r} does not take option(s) {sorted(options)}; "
            "backend= and torch.compile options go with engine='compile'."
        ) from None
    return factory(**options)


register_engine(EagerEngine.name, EagerEngine)
register_engine(TorchScriptEngine.name, TorchScriptEngine)
register_engine(CompileEngine.name, CompileEngine)
register_engine(AutoEngine.name, AutoEngine)
