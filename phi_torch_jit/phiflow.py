"""PhiFlow / PhiML integration.

Nothing here is needed to jit a PhiFlow step: :func:`phi_torch_jit.jit`
accepts PhiML tensors, fields and geometries as arguments and results, and
captures PhiML's custom gradients (e.g. the implicit pressure solve of
``fluid.make_incompressible``) with all the usual guarantees.

:func:`install` goes further for existing scripts that use PhiML's own
``math.jit_compile`` (``@jit_compile``): on the torch backend, the native
function PhiML compiles is then compiled by phi_torch_jit instead of PhiML's
torch tracer. PhiML keeps its own keying (auxiliary arguments, shapes);
phi_torch_jit does the record / compile / trace work underneath.
:func:`uninstall` restores PhiML's tracer. Both are idempotent.

Example:
    >>> import phi_torch_jit.phiflow
    >>> phi_torch_jit.phiflow.install()     # before or after `from phi.torch.flow import *`
    >>> # ... @jit_compile functions now run on phi_torch_jit ...
    >>> phi_torch_jit.phiflow.uninstall()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._jit import jit

__all__ = ["install", "uninstall", "installed"]

_ORIGINAL: dict[str, Any] = {}


def _torch_backend_class() -> Any:
    from phiml.backend.torch._torch_backend import TorchBackend

    return TorchBackend


def _compile_with_phi_torch_jit(self: Any, f: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement of ``TorchBackend.jit_compile``: compile PhiML's native function with us."""
    return jit(f)


def install() -> None:
    """Make PhiML's ``jit_compile`` use phi_torch_jit on the torch backend."""
    backend = _torch_backend_class()
    if "jit_compile" not in _ORIGINAL:
        _ORIGINAL["jit_compile"] = backend.__dict__["jit_compile"]
        backend.jit_compile = _compile_with_phi_torch_jit


def uninstall() -> None:
    """Restore PhiML's own torch tracer (functions compiled meanwhile keep their compilation)."""
    if "jit_compile" in _ORIGINAL:
        _torch_backend_class().jit_compile = _ORIGINAL.pop("jit_compile")


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return "jit_compile" in _ORIGINAL
