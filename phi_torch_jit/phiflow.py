"""PhiFlow / PhiML integration: :func:`install` routes PhiML's own ``math.jit_compile`` through
phi_torch_jit (the adapter ``phi_torch_jit.adapters.phiml`` has the details).

Nothing here is needed to jit a PhiFlow step: :func:`phi_torch_jit.jit` accepts PhiML tensors,
fields and geometries as arguments and results, and captures PhiML's custom gradients.

Example:
    >>> import phi_torch_jit.phiflow
    >>> phi_torch_jit.phiflow.install()     # before or after `from phi.torch.flow import *`
    >>> # ... @jit_compile functions now run on phi_torch_jit ...
    >>> phi_torch_jit.phiflow.uninstall()
"""

from __future__ import annotations

from .adapters.phiml._install import compiled_by_phi_torch_jit, install, installed, uninstall

__all__ = ["install", "uninstall", "installed", "compiled_by_phi_torch_jit"]
