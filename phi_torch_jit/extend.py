"""Extension points: how a library's values, passes, custom functions and solvers plug in.

The core of phi_torch_jit knows no library. What one needs goes through two registries,
reachable only through the functions below (docs/extending.md has a worked example):

* :func:`register_values` -- values of a library's types as arguments and results of a jitted
  function, in the spirit of pytree registration: ``flatten`` appends the value's torch tensors
  to a list and returns a hashable key (its static structure, part of the cache key);
  ``unflatten`` rebuilds a value from the key and new tensors. The tensors are traced; the key
  decides retraces (equal keys share a program).
* :func:`register_library` -- a :class:`Library` whose hooks run around our passes: a per-pass
  hook object (a library that keeps its own jit stack sees our record and trace passes as its
  jit), the forward to compile for its ``autograd.Function`` classes and the scope their
  backward runs in, checks its custom forwards defer to after each compiled call (convergence
  checks, solve records), its solvers captured as compiled loops, and which tracer warnings of
  its code cannot mean a wrong result (engine "torchscript").

Registering imports nothing of the library: each hook is asked when the core meets a value,
a class or code of it. ``phi_torch_jit`` registers its PhiML/PhiFlow adapter
(``phi_torch_jit.adapters.phiml``) this way, with no core module importing it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = [
    "ValueType",
    "register_values",
    "value_type_of",
    "Library",
    "PassHooks",
    "DeferredChecks",
    "LoopSolvers",
    "ClosureRoot",
    "register_library",
    "libraries",
]


@dataclass(frozen=True)
class ValueType:
    """How values of a library's types become torch tensors and a static key, and back.

    ``flatten(value, tensors)`` appends the value's torch tensors (program inputs or outputs)
    to ``tensors`` and returns its key: hashable, equal for values one program serves. A key
    may also have ``difference(other) -> str`` (what differs, for ``explain()``; default: the
    keys' reprs) and ``converted`` (True: flatten made tensors of other data, so the record
    pass runs on the rebuilt value, as the trace does). ``unflatten(key, tensors)`` takes the
    value's tensors from the iterator, in flatten's order, and returns the rebuilt value.
    """

    name: str
    """Names the values in messages (``explain()``, retrace reasons)."""
    matches: Callable[[Any], bool]
    """Whether an object is such a value; asked for objects no earlier rule took (tensors,
    lists, tuples, dicts, numbers, modules, dataclasses and named tuples are the core's own),
    so it should be cheap (a class test)."""
    flatten: Callable[[Any, list[torch.Tensor]], Hashable]
    unflatten: Callable[[Any, Iterator[torch.Tensor]], Any]


_VALUE_TYPES: list[ValueType] = []


def register_values(value_type: ValueType) -> None:
    """Make jitted functions accept and return values ``value_type`` matches.

    Raises:
        ValueError: a value type of the same name is registered already.
    """
    if any(v.name == value_type.name for v in _VALUE_TYPES):
        raise ValueError(f"phi_torch_jit: values named {value_type.name!r} are registered already")
    _VALUE_TYPES.append(value_type)


def value_type_of(obj: Any) -> ValueType | None:
    """The registered value type that matches ``obj``, first registered first; None: none."""
    for value_type in _VALUE_TYPES:
        if value_type.matches(obj):
            return value_type
    return None


class PassHooks(Protocol):
    """A library's view of one specialization's passes (made per record pass, kept for its
    trace pass)."""

    @property
    def used(self) -> bool:
        """Whether the library took part in the record pass (its custom gradients ran): a
        program the engine cannot capture may then fall back to a TorchScript trace (engine
        "compile" only)."""

    def active(self, recording: bool) -> AbstractContextManager[Any]:
        """Entered around the record pass (``recording``) and the trace pass."""

    def outside_user_call(self) -> AbstractContextManager[Any]:
        """Entered while the program runs for us, not for a call of the user's (a backend's
        warm-up on the trace inputs): records the library keeps of its calls are set aside."""


class DeferredChecks(Protocol):
    """Checks a library's code met while a custom forward was traced, when values were not
    available (a solve's convergence check); collected by :meth:`Library.forward_checks`."""

    tensors: list[torch.Tensor]
    """The values the checks need: extra outputs of the compiled forward, in order."""

    def __bool__(self) -> bool:
        """Whether any check was met."""

    def run(self, values: Sequence[torch.Tensor]) -> None:
        """After each compiled call, with ``tensors``' values: raise as eager code would."""

    def traced(self, values: Sequence[torch.Tensor]) -> None:
        """In the trace pass, with traced ``tensors``: note what the library records of the
        call (solve records opened inside the jitted function)."""


class LoopSolvers(Protocol):
    """A library's solvers with their loops captured as compiled blocks, shared by the custom
    functions one engine compiles (:meth:`Library.loop_solvers`).

    It may also have ``as_ops() -> ContextManager[None]``: while in effect on the calling
    thread, the library's code records each call of a captured solver as one op under
    ``make_fx`` (``engines._opaque_calls``) and reads no tensor values. Engines then capture
    the library's Python around the solvers as a graph, run straight-line, and check it like
    the Python form (NOTE [a solve's Python captured around its solvers]); without it, that
    Python runs on every call."""

    runs: int
    """How many times a captured solver ran (the check runs a function once)."""

    def calling(self, source: Callable[..., Any]) -> Callable[..., Any]:
        """``source`` run with the captured solvers in place of the library's."""

    def loops(self) -> Sequence[Any]:
        """The captured loops (``phi_torch_jit._loops.Loop``) that ran."""

    def describe(self) -> str:
        """One line for ``explain()``."""


ClosureRoot = tuple[str, int, tuple[tuple[str, Any], ...]]
"""``(method, cell, steps)``: the closure cell ``cell`` of the class's method ``method``
(``"forward"``, ``"backward"``), then steps down from its value: ``("closure", i)`` a
function's closure cell, ``("attr", name)``, ``("item", key)``."""


class Library:
    """A library adapter: override the hooks the library needs; each does nothing by default.

    Hooks are asked for every pass, class and code the core meets, so the defaults of a
    library that is not imported must be cheap (look into ``sys.modules``, never import it).
    """

    name = "library"

    def pass_hooks(self) -> PassHooks | None:
        """A new hook object for one specialization's passes, or None."""
        return None

    def ambient(self) -> tuple[tuple[str, Any], ...] | None:
        """The library's global settings that a traced program bakes in (PhiML's precision
        and default backend), as ``(name, value)`` pairs, or None where they are as usual.
        Part of every jitted call's cache key, as torch's default dtype is: a change
        retraces, and the programs of both settings stay cached. Asked on every call: it
        must cost well under a microsecond."""
        return None

    def custom_forward(self, cls: type) -> Callable[..., Any] | None:
        """The forward to run for the ``autograd.Function`` subclass ``cls`` in place of its
        own (asked once per class), or None: its own."""
        return None

    def backward_scope(self, cls: type) -> AbstractContextManager[Any] | None:
        """A context the backward of ``cls`` runs in when phi_torch_jit runs it, or None."""
        return None

    def closure_roots(self, cls: type) -> Sequence[ClosureRoot]:
        """Where the call's own values sit in the closures of ``cls``, a class this library
        gives a forward (:meth:`custom_forward`) and makes anew for calls with new values
        (PhiML: a solve's initial guess, closed over by its custom-gradient function). The
        tensors under each root become inputs of the custom function, as those of a class
        defined in the step do; a tensor under a root that cannot be replaced runs the
        specialization eagerly, warned. Empty: the class closes over no values of a call."""
        return ()

    def forward_checks(self, always: bool) -> AbstractContextManager[DeferredChecks] | None:
        """Collects the checks the library's code defers while a custom forward is traced (all
        of them, values available or not, if ``always``), or None."""
        return None

    def owns_code(self, source: Any) -> bool:
        """Whether ``source`` (a custom function's forward or backward) is the library's code,
        whose loops :meth:`loop_solvers` captures and whose checks the looped form defers."""
        return False

    def loop_solvers(self, capture: Callable[[Callable[..., Any], str], Any]) -> LoopSolvers | None:
        """The library's solvers captured with ``capture(function, label)`` (which returns a
        ``phi_torch_jit._loops.Captured``, or the reason it cannot as a string), or None."""
        return None

    def harmless_tracer_warning(self, warning: warnings.WarningMessage) -> bool:
        """Whether a TorchScript tracer warning raised in the library's code cannot mean a
        wrong result (engine "torchscript")."""
        return False

    def reads_input_shape(self, warning: warnings.WarningMessage) -> bool:
        """Whether a tracer warning is the library reading a traced tensor's shape: harmless
        unless the graph has an op whose output shape depends on values."""
        return False

    def configuration_classes(self) -> tuple[type, ...]:
        """Classes of the library whose instances hold a user's settings as attributes
        (PhiML's ``Solve``): where the step's state holds one, it is walked by attribute like
        a namespace, so a change in place (``SOLVE.x0 = guess``) retraces. Other objects of a
        library are guarded by identity. Asked at every walk: answer from a dict lookup."""
        return ()


_LIBRARIES: list[Library] = []
REGISTERED: Sequence[Library] = _LIBRARIES
"""The registered libraries, live (read-only; the cache key reads it on every call without a
function call: :func:`libraries` copies it)."""


def register_library(library: Library) -> None:
    """Add ``library``'s hooks (once per object; registering it again does nothing)."""
    if all(known is not library for known in _LIBRARIES):
        _LIBRARIES.append(library)


def libraries() -> tuple[Library, ...]:
    """The registered libraries, in registration order."""
    return tuple(_LIBRARIES)
