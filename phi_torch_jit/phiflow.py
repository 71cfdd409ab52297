"""PhiFlow / PhiML integration: :func:`install` routes PhiML's own ``math.jit_compile`` through
phi_torch_jit; :func:`uninstall` restores PhiML's paths.

Nothing here is needed to jit a PhiFlow step: :func:`phi_torch_jit.jit` accepts PhiML tensors,
fields and geometries as arguments and results, and captures PhiML's custom gradients. What
``install()`` changes, and the example, are in the adapter
(``phi_torch_jit.adapters.phiml._install``) and in docs/phiflow.md.
"""

from __future__ import annotations

from .adapters.phiml._install import compiled_by_phi_torch_jit, install, installed, uninstall

__all__ = ["install", "uninstall", "installed", "compiled_by_phi_torch_jit"]
