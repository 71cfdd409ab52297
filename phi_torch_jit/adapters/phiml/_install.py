"""PhiFlow / PhiML integration.

Nothing here is needed to jit a PhiFlow step: :func:`phi_torch_jit.jit`
accepts PhiML tensors, fields and geometries as arguments and results, and
captures PhiML's custom gradients (e.g. the implicit pressure solve of
``fluid.make_incompressible``) with all the usual guarantees.

:func:`install` goes further for existing scripts that use PhiML's own
``math.jit_compile`` (``@jit_compile``): while the default backend is torch, a
jit-compiled function without auxiliary arguments is called as
``phi_torch_jit.jit`` of it would be (the same keying, compiled program and
rebuilt outputs, so the same speed); one with auxiliary arguments (or a
``math.gradient`` of one) keeps PhiML's keying, and the native function PhiML
compiles is compiled by phi_torch_jit instead of PhiML's torch tracer.
Numbers among the arguments (a step index, a time step, numpy scalars) reach
the function as torch tensors, as under PhiML's own jit, so a rollout
``step(x, t)`` compiles once; ``math.trace_check`` answers from phi_torch_jit's
cache for the functions it serves. :func:`uninstall` restores PhiML's own
paths. Both are idempotent.

Example:
    >>> import phi_torch_jit.phiflow
    >>> phi_torch_jit.phiflow.install()     # before or after `from phi.torch.flow import *`
    >>> # ... @jit_compile functions now run on phi_torch_jit ...
    >>> phi_torch_jit.phiflow.uninstall()
"""

from __future__ import annotations

import numbers
import weakref
from collections.abc import Callable
from typing import Any

from ..._jit import JitFunction
from ...errors import describe_function

__all__ = ["install", "uninstall", "installed", "compiled_by_phi_torch_jit"]

_ORIGINAL: dict[str, Any] = {}


def _torch_backend_class() -> Any:
    from phiml.backend.torch._torch_backend import TorchBackend

    return TorchBackend


def _compile_with_phi_torch_jit(self: Any, f: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement of ``TorchBackend.jit_compile``: compile PhiML's native function with us.

    PhiML hands the native function the natives of its arguments, numpy arrays included (a
    geometry built from Python numbers); like PhiML's own torch jit, they are made torch
    tensors first.
    """
    owner = _phiml_jit_of(f)
    jitted = JitFunction(_one_pass_at_a_time(f, owner), label=_user_label(owner))
    backend = self

    def native(*args: Any) -> Any:
        return jitted(*backend.recursive_as_tensor(args))

    native.__wrapped__ = jitted  # type: ignore[attr-defined]
    return native


def _phiml_jit_of(native: Callable[..., Any]) -> Any:
    """PhiML's ``JitFunction`` whose native function ``native`` is (None if not found)."""
    code = getattr(native, "__code__", None)
    cells = dict(zip(code.co_freevars, native.__closure__ or ())) if code else {}
    return getattr(cells.get("self"), "cell_contents", None)


def _user_label(owner: Any) -> str | None:
    """``step (sim.py:12) under phiflow.install()`` for PhiML's jit of ``step``."""
    user = getattr(owner, "f", None)
    if not callable(user):
        return None
    return f"{describe_function(user)} under phi_torch_jit.phiflow.install()"


def _one_pass_at_a_time(native: Callable[..., Any], owner: Any) -> Callable[..., Any]:
    """``native``, forgetting the ``math.when_available`` callbacks of earlier passes first.

    PhiML's jit collects the callbacks met while its native function runs and returns their
    tensors as extra outputs, expecting one traced pass. phi_torch_jit runs it twice (record,
    trace) and both passes must return the same outputs, so each starts from an empty list:
    the callback then runs once per call, after it, as under PhiML's own jit. Its
    ``__wrapped__`` is the user's function that PhiML's native function runs (its globals
    and closures are guarded as a jitted function's: NOTE [Python reads]).
    """
    collects = hasattr(owner, "_extract_tensors") and hasattr(owner, "_post_call")

    def one_pass(*natives: Any) -> Any:
        if collects:  # a jit_compile's (a gradient's native function collects none)
            owner._extract_tensors.clear()
            owner._post_call.clear()
        return native(*natives)

    one_pass.__name__ = one_pass.__qualname__ = getattr(native, "__name__", "native")
    user = getattr(owner, "f", None)  # the user's function (of a math.gradient: its f)
    user = getattr(user, "f", user) if type(user).__name__ == "GradientFunction" else user
    if callable(user):  # what PhiML's native function runs: the guard stage walks it
        one_pass.__wrapped__ = user  # type: ignore[attr-defined]
    return one_pass


_DIRECT: weakref.WeakKeyDictionary[Any, JitFunction[..., Any] | None] = weakref.WeakKeyDictionary()
"""PhiML ``JitFunction`` -> the phi_torch_jit function its calls go to (None: PhiML's path)."""


def _phiml_jit_class() -> Any:
    from phiml.math._functional import JitFunction as PhiMLJit

    return PhiMLJit


def _direct(owner: Any) -> JitFunction[..., Any] | None:
    """What a call of PhiML's jit ``owner`` goes to directly (None: PhiML's own path, for
    auxiliary arguments, which PhiML keys by reference, and gradient functions)."""
    if owner in _DIRECT:
        return _DIRECT[owner]
    from phiml.math._functional import GradientFunction

    f = getattr(owner, "f", None)
    direct = None
    if callable(f) and not owner.auxiliary_args and not isinstance(f, GradientFunction):
        direct = JitFunction(f, label=_user_label(owner))
    _DIRECT[owner] = direct
    return direct


def _call_through_phi_torch_jit(self: Any, *args: Any, **kwargs: Any) -> Any:
    """Replacement of PhiML's ``JitFunction.__call__`` while installed: on the torch backend,
    a call of ``phi_torch_jit.jit`` of the function (PhiML's keying, buffer bookkeeping and
    output assembly, with PhiFlow's shape checks, cost 10-20% of a smoke step)."""
    from phiml.backend import default_backend
    from phiml.math._lin_trace import LinearTraceInProgress

    direct = _direct(self)
    if direct is None or default_backend().name != "torch":
        return _ORIGINAL["__call__"](self, *args, **kwargs)
    args, kwargs = _numbers_as_tensors((args, kwargs))
    try:
        return direct(*args, **kwargs)
    except LinearTraceInProgress:  # called inside PhiML's linear tracing, as PhiML does
        return self.f(*args, **kwargs)


def _numbers_as_tensors(value: Any) -> Any:
    """``value`` with the numbers in it (Python and numpy scalars, numpy arrays of numbers;
    inside tuples, lists and dicts) made torch tensors by PhiML's torch backend, as PhiML's
    jit hands its function natives: traced inputs, not constants of the key (a step index
    must not retrace)."""
    if isinstance(value, numbers.Number) or _is_numpy_number(value):
        from phiml.backend.torch import TORCH

        return TORCH.as_tensor(value)
    if type(value) in (tuple, list):
        return type(value)(_numbers_as_tensors(v) for v in value)
    if type(value) is dict:
        return {k: _numbers_as_tensors(v) for k, v in value.items()}
    return value


def _is_numpy_number(value: Any) -> bool:
    """A numpy array or scalar of booleans or numbers (PhiML's jit makes those natives).

    The type is checked before any attribute is read: a PhiFlow ``Field``'s ``dtype`` is
    computed from its geometry and values, and reading it for every argument of every call
    cost 2.2 ms per Gray-Scott step under ``install()`` (0.36 ms of program)."""
    if type(value).__module__ != "numpy":
        return False
    kind = getattr(getattr(value, "dtype", None), "kind", "")
    return kind != "" and kind in "biufc"


def _trace_check(traced_function: Any, *args: Any, **kwargs: Any) -> tuple[bool, str]:
    """``math.trace_check`` while installed: a function phi_torch_jit serves answers from its
    cache (whether these arguments have a compiled specialization), as PhiML's answers from
    its traces."""
    direct = _direct(traced_function) if isinstance(traced_function, _phiml_jit_class()) else None
    if direct is None:
        return _ORIGINAL["trace_check"](traced_function, *args, **kwargs)  # type: ignore[no-any-return]
    args, kwargs = _numbers_as_tensors((args, kwargs))
    traced, why = direct.trace_check(*args, **kwargs)
    return traced, "Function has not yet been traced" if why == "not yet traced" else why


def install() -> None:
    """Make PhiML's ``jit_compile`` use phi_torch_jit on the torch backend."""
    backend = _torch_backend_class()
    if "jit_compile" not in _ORIGINAL:
        _ORIGINAL["jit_compile"] = backend.__dict__["jit_compile"]
        backend.jit_compile = _compile_with_phi_torch_jit
    phiml_jit = _phiml_jit_class()
    if "__call__" not in _ORIGINAL:
        _ORIGINAL["__call__"] = phiml_jit.__dict__["__call__"]
        phiml_jit.__call__ = _call_through_phi_torch_jit
    if "trace_check" not in _ORIGINAL:
        import phiml.math
        import phiml.math._functional as functional

        _ORIGINAL["trace_check"] = functional.trace_check
        functional.trace_check = phiml.math.trace_check = _trace_check


def uninstall() -> None:
    """Restore PhiML's own torch tracer (functions compiled meanwhile keep their compilation)."""
    if "jit_compile" in _ORIGINAL:
        _torch_backend_class().jit_compile = _ORIGINAL.pop("jit_compile")
    if "__call__" in _ORIGINAL:
        _phiml_jit_class().__call__ = _ORIGINAL.pop("__call__")
    if "trace_check" in _ORIGINAL:
        import phiml.math
        import phiml.math._functional as functional

        functional.trace_check = phiml.math.trace_check = _ORIGINAL.pop("trace_check")


def compiled_by_phi_torch_jit(phiml_jit: Any) -> JitFunction[..., Any] | None:
    """The phi_torch_jit function that serves the calls of PhiML's jit ``phiml_jit`` while
    installed (for ``explain()``, ``num_traces``); None if its calls take PhiML's path (then
    ``phiml_jit.traces`` hold phi_torch_jit functions as native functions)."""
    return _direct(phiml_jit)


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return "jit_compile" in _ORIGINAL
