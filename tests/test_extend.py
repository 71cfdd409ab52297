"""The extension points (``phi_torch_jit.extend``) and the small pytree adapter built on them.

PhiML's adapter (``adapters.phiml``) is tested through PhiFlow programs (test_phiflow,
test_phiml_cg); here: that the points are general -- a value type of the user's own, a library
whose hooks run around the passes -- and that the core imports no library.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.utils._pytree as torch_pytree
from helpers import Counter, engine_name

import phi_torch_jit as ptj
from phi_torch_jit import extend
from phi_torch_jit._signature import flatten_arguments
from phi_torch_jit._spec_text import first_difference
from phi_torch_jit.adapters.pytree import register_pytree_values
from phi_torch_jit.errors import SignatureError

assert_close = torch.testing.assert_close


class Particles:
    """A user's state class: positions and velocities traced, the time step keyed."""

    def __init__(self, x: torch.Tensor, v: torch.Tensor, dt: float) -> None:
        self.x, self.v, self.dt = x, v, dt


def _flatten(p: Particles) -> tuple[list[Any], Any]:
    return [p.x, p.v, p.dt], None


def _unflatten(leaves: list[Any], context: Any) -> Particles:
    return Particles(*leaves)


torch_pytree.register_pytree_node(Particles, _flatten, _unflatten)
register_pytree_values(Particles)


def _advance(p: Particles) -> Particles:
    force = -p.x
    v = p.v + p.dt * force
    return Particles(p.x + p.dt * v, v, p.dt)


def test_a_pytree_class_of_the_users_is_an_argument_and_a_result() -> None:
    step = ptj.jit(_advance)
    p = q = Particles(torch.randn(16, 3), torch.randn(16, 3), 0.1)
    for _ in range(4):  # the compiled program's result is the next call's argument
        p, q = step(p), _advance(q)
        assert isinstance(p, Particles) and p.dt == 0.1
        assert_close(p.x, q.x)
        assert_close(p.v, q.v)
    assert step.num_traces == 1


def test_a_pytree_values_key_retraces_on_what_is_not_traced() -> None:
    step = ptj.jit(_advance)
    x, v = torch.randn(8, 3), torch.randn(8, 3)
    step(Particles(x, v, 0.1))
    step(Particles(x + 1, v, 0.1))  # new tensor values: the same program
    assert step.num_traces == 1
    slower = step(Particles(x, v, 0.05))  # a non-tensor leaf is part of the key
    assert step.num_traces == 2
    assert_close(slower.x, _advance(Particles(x, v, 0.05)).x)
    old = flatten_arguments((Particles(x, v, 0.1),), {}, "f", ("p",))[0]
    new = flatten_arguments((Particles(x, v, 0.05),), {}, "f", ("p",))[0]
    assert first_difference(old, new, ("p",)) == "p: leaf 2: 0.1 -> 0.05"
    step(Particles(torch.randn(4, 3), torch.randn(4, 3), 0.1))  # shapes are keyed
    assert step.num_traces == 3


def test_gradients_flow_through_a_pytree_value() -> None:
    step = ptj.jit(_advance)
    x = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(8, 3, dtype=torch.float64)
    (gx,) = torch.autograd.grad(step(Particles(x, v, 0.1)).x.square().sum(), x)
    (want,) = torch.autograd.grad(_advance(Particles(x, v, 0.1)).x.square().sum(), x)
    assert_close(gx, want)


def test_registering_a_class_pytree_does_not_know_fails_clearly() -> None:
    class Unknown:
        pass

    with pytest.raises(TypeError, match=r"not registered with torch\.utils\._pytree"):
        register_pytree_values(Unknown)


def test_an_unhashable_pytree_leaf_is_refused_naming_the_class() -> None:
    step = ptj.jit(_advance)
    with pytest.raises(SignatureError, match="Particles argument is an unhashable set"):
        step(Particles(torch.zeros(2), torch.zeros(2), {0.1}))  # type: ignore[arg-type]


def test_a_value_type_name_is_registered_once() -> None:
    with pytest.raises(ValueError, match="registered already"):
        extend.register_values(extend.ValueType("torch pytree", bool, _flatten, _unflatten))


_IN_SCOPE: ContextVar[bool] = ContextVar("toy_library_scope", default=False)
_SCOPED_RUNS = Counter()  # instrumentation (slotted: no guard watches it)


class _Scaled(torch.autograd.Function):
    """A library's Function whose own forward must not run under our passes."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the library's forward was replaced")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _IN_SCOPE.get():  # the library's backward scope is entered around this run
            _SCOPED_RUNS.gradient += 1
        return 3 * grad


def _replacement(ctx: Any, x: torch.Tensor) -> torch.Tensor:
    return 3 * x


@dataclass
class _Hooks:
    passes: list[bool]
    used: bool = False

    @contextmanager
    def active(self, recording: bool) -> Iterator[None]:
        self.passes.append(recording)
        yield

    @contextmanager
    def outside_user_call(self) -> Iterator[None]:
        yield


class _ToyLibrary(extend.Library):
    name = "toy"

    def __init__(self) -> None:
        self.passes: list[bool] = []
        self.backward_scopes = 0

    def pass_hooks(self) -> _Hooks:
        return _Hooks(self.passes)

    def custom_forward(self, cls: type) -> Any:
        return _replacement if cls is _Scaled else None

    @contextmanager
    def _scope(self) -> Iterator[None]:
        self.backward_scopes += 1
        token = _IN_SCOPE.set(True)
        try:
            yield
        finally:
            _IN_SCOPE.reset(token)

    def backward_scope(self, cls: type) -> Any:
        return self._scope() if cls is _Scaled else None


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> _ToyLibrary:
    library = _ToyLibrary()
    monkeypatch.setattr(extend, "_LIBRARIES", [*extend.libraries()])
    extend.register_library(library)
    extend.register_library(library)  # once per object
    assert extend.libraries().count(library) == 1
    return library


@pytest.mark.all_engines
def test_a_librarys_hooks_run_around_the_passes_and_its_functions(
    toy: _ToyLibrary, jit_engine: str
) -> None:
    """A library registered by a test: its pass hooks see the record pass and the trace pass,
    its Function runs the forward it gives, its backward runs in the scope it gives."""

    def f(x: torch.Tensor) -> torch.Tensor:
        return _Scaled.apply(x).sin()

    scoped_before = _SCOPED_RUNS.gradient
    step = ptj.jit(f)
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    for _ in range(3):
        y = step(x)
        assert_close(y, (3 * x).sin())
        (g,) = torch.autograd.grad(y.sum(), x)
        assert_close(g, 3 * (3 * x).cos())
    assert step.num_traces == 1
    if engine_name(jit_engine) != "eager":
        assert toy.passes[:2] == [True, False]  # record, then trace
    assert toy.backward_scopes >= 1  # asked only where a backward runs
    assert _SCOPED_RUNS.gradient > scoped_before  # and the backward ran inside it


def _made_per_call(scale: torch.Tensor) -> type:
    """A library's class made anew for each call, its forward reading the call's settings two
    objects below a closure cell of the native function it wraps (deeper than a class of the
    user's may hold them: the library names the root)."""
    settings = {"solve": _Settings(scale)}

    def native(x: torch.Tensor) -> torch.Tensor:
        return x * settings["solve"].scale

    class PerCall(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return native(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad * settings["solve"].scale

    return PerCall


@dataclass
class _Settings:
    scale: torch.Tensor


class _RootedLibrary(extend.Library):
    """Gives the forward of ``PerCall`` classes and names where their values sit."""

    name = "rooted"

    def __init__(self, root: tuple[Any, ...] = ()) -> None:
        self.root = root

    def custom_forward(self, cls: type) -> Any:
        return cls.forward if cls.__qualname__.endswith("PerCall") else None

    def closure_roots(self, cls: type) -> tuple[extend.ClosureRoot, ...]:
        if not cls.__qualname__.endswith("PerCall"):
            return ()
        code = cls.forward.__code__
        native = cls.forward.__closure__[code.co_freevars.index("native")].cell_contents
        inner = native.__code__.co_freevars.index("settings")
        cell = code.co_freevars.index("native")
        return (("forward", cell, self.root or (("closure", inner),)),)


def _per_call_step(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _made_per_call(scale).apply(x).cos()


@pytest.mark.all_engines
def test_a_librarys_class_made_per_call_takes_each_calls_tensors_where_the_library_says(
    monkeypatch: pytest.MonkeyPatch, jit_engine: str
) -> None:
    """The tensors under the roots a library names (:meth:`Library.closure_roots`) are inputs of
    its class's custom function: each call's scale, not the first call's, with one trace."""
    monkeypatch.setattr(extend, "_LIBRARIES", [*extend.libraries()])
    extend.register_library(_RootedLibrary())
    step = ptj.jit(_per_call_step)
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    for n in range(4):
        scale = torch.full((5,), 1.0 + n, dtype=torch.float64)
        y = step(x, scale)
        assert_close(y, (x * scale).cos())
        (g,) = torch.autograd.grad(y.sum(), x)
        assert_close(g, -(x * scale).sin() * scale)
    assert step.num_traces == 1


def test_a_closure_root_that_is_not_there_runs_the_step_eagerly_warned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A root the class does not have (the library changed): never the first call's values."""
    monkeypatch.setattr(extend, "_LIBRARIES", [*extend.libraries()])
    extend.register_library(_RootedLibrary(root=(("closure", 0), ("attr", "gone"))))
    step = ptj.jit(_per_call_step)
    x = torch.randn(5, dtype=torch.float64)
    with pytest.warns(ptj.JitWarning, match="closure root"):
        step(x, torch.full((5,), 2.0, dtype=torch.float64))
    for n in range(3):
        scale = torch.full((5,), 3.0 + n, dtype=torch.float64)
        assert_close(step(x, scale), (x * scale).cos())


def test_importing_and_jitting_pure_torch_imports_no_library() -> None:
    """The adapters register without importing their libraries: a pure-torch program never
    loads PhiML or PhiFlow."""
    code = textwrap.dedent(
        """
        import sys, torch, phi_torch_jit as ptj
        step = ptj.jit(lambda x: x.sin() * 2)
        step(torch.ones(3)); step(torch.ones(3))
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("phiml", "phi")))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHI_TORCH_JIT_")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True,
        env=env,
    )  # fmt: skip
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
