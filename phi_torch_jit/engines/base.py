"""The engine interface: what an engine is given and what it returns.

See :mod:`phi_torch_jit.engines` for the registry and the built-in engines.
"""

from __future__ import annotations

import abc
import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

__all__ = [
    "Engine",
    "FunctionTarget",
    "CompiledFunction",
    "CompiledModule",
    "Mode",
    "RANDOM_OPS",
    "captured_tensor_message",
]

Mode = Literal["traced", "scripted", "looped", "python"]


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
    loop_source: Callable[..., Any] | None = None
    """The user's function inside ``fn`` whose loops an engine may capture."""
    with_loop_source: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None
    """Given a function behaving like ``loop_source``, ``fn`` with it in its place."""
    reference: Callable[[], tuple[torch.Tensor, ...]] | None = None
    """Computes ``expected`` when it is None and an engine needs it (runs ``fn`` as Python on
    ``example_inputs``: a backward, whose outputs no record pass kept)."""


@dataclass(frozen=True)
class CompiledFunction:
    """The result of :meth:`Engine.compile_function`."""

    run: Callable[..., Any]
    """Call with the flat tensors; returns a tuple of tensors."""
    mode: Mode
    """``traced``: a faithful trace; ``scripted``: control flow kept; ``looped``: Python whose
    loops run as compiled blocks (``phi_torch_jit._loops``); ``python``: runs as Python."""
    reason: str = ""
    """Why it is not ``traced``, if it is not; for a ``traced`` one, what was captured, if
    more than the function (``_solve_graphs``)."""
    origin: Any = None
    """The flat function the program was captured from, where it is not the target's own
    (a library's solve captured around its solvers, ``_solve_graphs``): the deferred checks
    it collected are the program's."""

    @property
    def runs_python(self) -> bool:
        """Whether each call runs the user's Python (``looped`` too: around its loops), so
        what it leaves on ``ctx`` is that call's."""
        return self.mode in ("looped", "python")


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
    describe: Callable[[], tuple[str, ...]] | None = None
    """Notes that change after compiling (engine ``"auto"``: the tier serving calls now)."""
    wait: Callable[[float | None], bool] | None = None
    """Waits for work the engine does after the first call (a background compile); False if
    the timeout passed first."""
    keep_alive: Callable[[tuple[Any, ...]], None] | None = None
    """Given the objects the program's ops need (the custom calls owning its ``phi_torch_jit``
    ops); an engine that compiles after the first call keeps them alive until it is done."""
    close: Callable[[], None] | None = None
    """Called when the specialization is dropped (``clear_caches()``, ``max_traces``): work
    still queued for it is skipped."""
    defer: Callable[[int], tuple[str, ...]] | None = None
    """Instead of :attr:`warm_up`, for a program whose traced Python branched on tensor values
    (a path that may never be taken again): serve it without the backend's compile until it is
    reused; given the number of value guards, returns notes for ``explain()``. None: the
    engine has no such mode."""
    served: Callable[[], None] | None = None
    """With :attr:`defer`: told after each call whose value guards held (a call whose guards
    failed took another path, and does not count as a reuse)."""
    sizes_left_dynamic: bool = False
    """Whether the program computes the sizes its static forms were traced for itself, for
    any values: their value guards need no check (NOTE [value-dependent sizes])."""
    on_new_program: Callable[[Callable[[], None]], None] | None = None
    """Registers a callback, called when another program starts serving calls after the first
    (engine "auto"'s switch to its compiled tier, engine "compile"'s compile on reuse): what
    was measured of the old one no longer holds (NOTE [never slower than eager])."""


class Engine(abc.ABC):
    """Turns flat functions and wrapper modules into compiled callables."""

    name: ClassVar[str]
    """The name users pass as ``jit(engine=...)``."""
    passthrough: ClassVar[bool] = False
    """If True, jitted functions just call the user function (no recording, no cache)."""
    keeps_grad_mode: ClassVar[bool] = False
    """Whether grad-mode changes inside the function (``torch.no_grad()`` blocks) are part of
    what :meth:`compile_module` compiles; if not, such functions run eagerly."""
    keeps_functorch: ClassVar[bool] = True
    """Whether torch.func transforms applied inside the function (``vmap``, ``grad``) are
    compiled faithfully; if not, such functions run eagerly."""
    captures_autograd: ClassVar[bool] = False
    """Whether ``torch.autograd.grad`` inside the function becomes ops of the compiled program
    (:mod:`.._inner_grad`); if not, such functions run eagerly."""
    captures_graph: ClassVar[bool] = False
    """Whether :meth:`compile_module` captures a graph whose custom ops' backward cannot
    receive per-call ctx values (NOTE [opaque backward]); custom calls are compiled knowing it."""

    def tracing_session(self, owner: str) -> contextlib.AbstractContextManager[Any] | None:
        """The context a cache miss of ``owner`` (the user's function) specializes in
        (record pass to capture), or None if this engine cannot trace at this moment: the miss
        is then served by the Python function alone, without the record pass's overhead.
        Engine ``"auto"`` reserves its tracing lock for the whole specialization, so its
        compile thread cannot start between two of the specialization's captures; None while
        that thread compiles, except while it waits for a C++ build (NOTE [one tracing
        thread]). A ``NotNow`` from inside stays possible."""
        return contextlib.nullcontext()

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
              "exponential", "geometric", "cauchy", "poisson",
              "scaled_dot_product_attention")  # fmt: skip
"""Substrings of op names that draw random numbers (for ``CompiledModule.uses_rng``);
attention draws when its ``dropout_p`` is not 0."""


def captured_tensor_message(label: str) -> str:
    """The TraceError text for a tensor requiring grad that a trace would turn into a constant."""
    return (
        f"phi_torch_jit: {label} uses a tensor that requires grad but is neither an argument, "
        "a global or closure variable, nor a parameter of a module it calls (an attribute of a "
        "plain object?). Pass it as an argument, or hold it in an nn.Module that the function "
        "calls or registers with phi_torch_jit.register_module_call(module)."
    )
