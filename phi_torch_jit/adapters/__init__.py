"""Library adapters: what phi_torch_jit knows of particular libraries, plugged into the core's
extension points (:mod:`phi_torch_jit.extend`). No core module imports an adapter; the package's
``__init__`` registers them, and registering imports nothing of the library.

* :mod:`.phiml` -- PhiML and PhiFlow: their values as arguments and results, their custom
  gradients inside our passes, their CG solvers captured as loops, ``phiflow.install()``.
* :mod:`.pytree` -- classes registered with ``torch.utils._pytree``, as arguments and results
  (a small adapter: the worked example of docs/extending.md).
"""
