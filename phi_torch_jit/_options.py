"""The options of ``jit()``: validated once, with the default engine from the environment."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ._meter import FALLBACKS
from ._value_guards import GUARD_POLICIES
from .engines import Engine, get_engine
from .errors import ConfigurationError, UsageError

__all__ = ["DISABLE_ENV", "ENGINE_ENV", "Options", "copy_names", "positional_names"]

DISABLE_ENV = "PHI_TORCH_JIT_DISABLE"
"""Set to ``1`` to make every jitted function created afterwards use engine ``eager``."""

ENGINE_ENV = "PHI_TORCH_JIT_ENGINE"
"""The engine of jitted functions created without ``engine=``: a name, or ``compile:<backend>``."""


SIDE_EFFECTS = ("eager", "trace")
"""``jit(side_effects=...)``: a step that changes Python state it reads runs eagerly, warned
(``"eager"``, the default: results and side effects as eagerly), or is compiled with its
side effects happening while tracing only (``"trace"``, JAX's rule: faster, documented in
docs/guarded.md). NOTE [side effects of the step]."""


@dataclass(frozen=True)
class Options:
    """What ``jit(fn, ...)`` was asked for, checked."""

    engine: Engine
    """The engine that compiles (``eager`` under ``PHI_TORCH_JIT_DISABLE=1``)."""
    max_traces: int
    """Specializations kept before the least recently used are dropped (>= 1)."""
    guard_hooks: bool
    """Whether module guards check hooks and parameter identity too."""
    on_guard_failure: str
    """One of :data:`._value_guards.GUARD_POLICIES`."""
    side_effects: str = "eager"
    """One of :data:`SIDE_EFFECTS`: what a specialization that changes user state does."""
    fallback: str = "measure"
    """One of :data:`._meter.FALLBACKS`: serve the faster of compiled and eager code."""

    @classmethod
    def of(
        cls,
        fn: Any,
        engine: str | Engine | None,
        max_traces: int,
        guard_hooks: bool,
        on_guard_failure: str,
        engine_options: dict[str, Any],
        side_effects: str = "eager",
        fallback: str = "measure",
    ) -> Options:
        """Validate ``jit()``'s arguments; raise UsageError / ConfigurationError naming them."""
        if not callable(fn):
            raise UsageError(f"phi_torch_jit: jit needs a callable, got {type(fn).__name__}.")
        if not isinstance(max_traces, int) or max_traces < 1:
            raise ConfigurationError(
                f"phi_torch_jit: max_traces must be an int >= 1, got {max_traces!r}."
            )
        if on_guard_failure not in GUARD_POLICIES:
            raise ConfigurationError(
                f"phi_torch_jit: on_guard_failure must be one of {GUARD_POLICIES}, "
                f"got {on_guard_failure!r}."
            )
        if side_effects not in SIDE_EFFECTS:
            raise ConfigurationError(
                f"phi_torch_jit: side_effects must be one of {SIDE_EFFECTS}, got {side_effects!r}."
            )
        if fallback not in FALLBACKS:
            raise ConfigurationError(
                f"phi_torch_jit: fallback must be one of {FALLBACKS}, got {fallback!r}."
            )
        engine_options = {k: v for k, v in engine_options.items() if v is not None}
        resolved = get_engine(_default_engine(engine_options) if engine is None else engine,
                              engine_options)  # fmt: skip
        if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
            resolved = get_engine("eager")
        return cls(resolved, max_traces, guard_hooks, on_guard_failure, side_effects, fallback)


def _default_engine(options: dict[str, Any]) -> str:
    """The engine named by ``PHI_TORCH_JIT_ENGINE``, else ``"auto"`` (TorchScript-free: the
    captured graph served at once, compiled by inductor on a background thread)."""
    name, _, backend = os.environ.get(ENGINE_ENV, "").partition(":")
    if backend and "backend" not in options:
        options["backend"] = backend
    return name or "auto"


def positional_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    """Names of ``fn``'s positional parameters, for messages about arguments."""
    target = fn.forward if isinstance(fn, nn.Module) else fn
    try:
        params = inspect.signature(target).parameters.values()
    except Exception:  # no signature; or the object's __getattr__ raised (KeyError: probe 50)
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


def keywords_in_order(fn: Callable[..., Any]) -> bool:
    """Whether the order of ``fn``'s keyword arguments can matter: it takes ``**kwargs``
    (a loop over ``kw.items()`` follows the call's order; probe 36c), or its signature
    cannot be read. Named keywords are keyed in name order (one specialization for
    ``f(a=1, b=2)`` and ``f(b=2, a=1)``)."""
    target = fn.forward if isinstance(fn, nn.Module) else fn
    try:
        params = inspect.signature(target).parameters.values()
    except Exception:  # as in positional_names
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def copy_names(wrapper: Any, fn: Any) -> None:
    """``functools.update_wrapper``, for any callable: an object whose ``__getattr__`` raises
    something else than AttributeError (a config backed by a dict: ``KeyError``, probe 50)
    keeps the names it has."""
    for name in functools.WRAPPER_ASSIGNMENTS:
        try:
            value = getattr(fn, name)
        except Exception:  # the user's __getattr__: no such attribute
            continue
        setattr(wrapper, name, value)
    try:
        own = vars(fn)
    except Exception:  # no __dict__ (slots, C)
        own = {}
    wrapper.__dict__.update(own)
    wrapper.__wrapped__ = fn
