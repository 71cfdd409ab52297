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
:func:`get_engine`; those are the only ways to reach the registry. Built in:
``"torchscript"`` (default), ``"compile"`` (torch.compile, any backend) and
``"eager"`` (nothing compiled).
"""

from __future__ import annotations

import abc
import inspect
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from ..errors import ConfigurationError, UsageError

__all__ = [
    "Engine",
    "FunctionTarget",
    "CompiledFunction",
    "CompiledModule",
    "Mode",
    "register_engine",
    "get_engine",
    "available_engines",
]

Mode = Literal["traced", "scripted", "python"]


@dataclass(frozen=True)
class FunctionTarget:
    """A flat function to compile."""

    fn: Callable[..., tuple[torch.Tensor, ...]]
    """Takes ``example_inputs``-like tensors, returns a tuple of tensors."""
    example_inputs: tuple[torch.Tensor, ...]
    """Real inputs to trace with."""
    label: str
    """What this is, for logs, e.g. ``forward of solve (demo.py:12)``."""
    scriptable: Callable[..., Any] | None = None
    """The user's own function if it takes exactly the flat tensors; an engine may script it."""
    expected: tuple[torch.Tensor, ...] | None = None
    """Outputs recorded for ``example_inputs``; an alternative compilation must reproduce them."""


@dataclass(frozen=True)
class CompiledFunction:
    """The result of :meth:`Engine.compile_function`."""

    run: Callable[..., Any]
    """Call with the flat tensors; returns a tuple of tensors."""
    mode: Mode
    """``traced``: a faithful trace; ``scripted``: control flow kept; ``python``: runs as Python."""
    reason: str = ""
    """Why it is not ``traced``, if it is not."""


@dataclass(frozen=True)
class CompiledModule:
    """The result of :meth:`Engine.compile_module`."""

    run: Callable[..., tuple[torch.Tensor, ...]]
    """Call with the flat input tensors; returns the flat output tensors."""
    tracer_warnings: tuple[warnings.WarningMessage, ...] = ()
    """Tracer warnings from user code while compiling; the caller shows the relevant ones."""
    uses_rng: bool = True
    """Whether running it may draw random numbers (False only when the engine is sure)."""
    notes: tuple[str, ...] = ()
    """What the engine did, for ``explain()`` (e.g. graphs compiled, a fallback and why)."""
    warm_up: Callable[[], tuple[str, ...]] | None = None
    """Run once by the trace stage after the trace, outside any frame but with module state
    and RNG still rewound, so a backend's compile time is paid by the first call; returns
    more notes for ``explain()``."""


class Engine(abc.ABC):
    """Turns flat functions and wrapper modules into compiled callables."""

    name: ClassVar[str]
    """The name users pass as ``jit(engine=...)``."""
    passthrough: ClassVar[bool] = False
    """If True, jitted functions just call the user function (no recording, no cache)."""
    captures_graph: ClassVar[bool] = False
    """Whether :meth:`compile_module` captures a graph whose custom ops' backward cannot
    receive per-call ctx values (NOTE [opaque backward]); custom calls are compiled knowing it."""
    torchscript_tracing: ClassVar[bool] = True
    """Whether :meth:`compile_module` traces with TorchScript's tracer. PhiML's custom
    gradients only cooperate with that tracer; other engines hand such functions over to
    engine ``"torchscript"`` (noted in ``explain()``)."""

    @abc.abstractmethod
    def compile_function(self, target: FunctionTarget) -> CompiledFunction:
        """Compile a flat function, or explain why it must run as Python."""

    @abc.abstractmethod
    def compile_module(
        self, module: nn.Module, example_inputs: tuple[torch.Tensor, ...], label: str
    ) -> CompiledModule:
        """Compile ``module.forward`` for inputs like ``example_inputs``."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


RANDOM_OPS = ("rand", "dropout", "bernoulli", "normal", "multinomial", "uniform",
              "exponential", "geometric", "cauchy", "poisson")  # fmt: skip
"""Substrings of op names that draw random numbers (for ``CompiledModule.uses_rng``)."""


def captured_tensor_message(label: str) -> str:
    """The TraceError text for a tensor requiring grad that a trace would turn into a constant."""
    return (
        f"phi_torch_jit: {label} uses a tensor that requires grad but is neither an argument "
        "nor a parameter of a module it calls (a closure or global?). Pass it as an argument, or "
        "hold it in an nn.Module that the function calls or registers with "
        "phi_torch_jit.register_module_call(module)."
    )


_REGISTRY: dict[str, Callable[[], Engine]] = {}


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


def _register_builtin() -> None:
    from .compile import CompileEngine
    from .eager import EagerEngine
    from .torchscript import TorchScriptEngine

    register_engine(EagerEngine.name, EagerEngine)
    register_engine(TorchScriptEngine.name, TorchScriptEngine)
    register_engine(CompileEngine.name, CompileEngine)


_register_builtin()
