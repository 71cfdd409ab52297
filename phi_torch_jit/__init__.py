"""phi_torch_jit: compile differentiable PyTorch simulation steps, custom gradients included.

Public surface: :func:`jit`, :func:`custom_gradient`, :func:`register_module_call`
and the error hierarchy rooted at :class:`JitError`. Engines live in
:mod:`phi_torch_jit.engines`.
"""

from ._custom import CustomFunction, custom_gradient
from ._jit import JitFunction, clear_caches, jit, wait_compiled
from ._record import register_module_call
from .errors import (
    ConfigurationError,
    CustomFunctionError,
    GradientError,
    GuardError,
    JitError,
    JitWarning,
    OutputError,
    ReplayError,
    SignatureError,
    TorchVersionError,
    TraceError,
    UsageError,
)

__all__ = [
    "jit",
    "JitFunction",
    "clear_caches",
    "wait_compiled",
    "custom_gradient",
    "CustomFunction",
    "register_module_call",
    "JitError",
    "SignatureError",
    "OutputError",
    "ReplayError",
    "CustomFunctionError",
    "GradientError",
    "TraceError",
    "GuardError",
    "ConfigurationError",
    "UsageError",
    "TorchVersionError",
    "JitWarning",
]

__version__ = "0.1.0"

from .adapters import phiml as _phiml_adapter  # noqa: F401  registers PhiML's hooks
from .adapters import pytree as _pytree_adapter  # noqa: F401  registers its value type
