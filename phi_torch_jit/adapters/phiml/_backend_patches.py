"""Patches of PhiML's torch backend while our passes run (installed reference-counted)."""

from __future__ import annotations

from typing import Any

import torch

from ..._compat import get_tracing_state
from ..._patches import RefCounted
from ...errors import RunEagerly

__all__ = ["LOOPS", "SPARSE_COO"]


class _WhileLoop:
    """``TorchBackend.while_loop`` that never lets a trace repeat a fixed iteration count.

    PhiML's torch backend unrolls ``while_loop`` to ``max_iter`` iterations under a TorchScript
    trace (with a RuntimeWarning): a loop whose count depends on values would then be wrong
    for other values. In a record pass, a loop outside any custom function is noted (the
    specialization runs eagerly, with one warning); under a trace it raises ``RunEagerly``, so a
    custom forward being compiled runs as Python instead (NOTE [PhiML bridge])."""

    def __init__(self) -> None:
        self.original: Any = None

    def install(self) -> None:
        from phiml.backend.torch._torch_backend import TorchBackend

        original = self.original = TorchBackend.__dict__["while_loop"]

        def while_loop(self_: Any, loop: Any, values: Any, max_iter: Any) -> Any:
            if get_tracing_state() is not None:
                raise RunEagerly(
                    f"it runs a PhiML while_loop, which a trace would unroll to {max_iter} "
                    "iterations"
                )
            from ..._watched_calls import note_unguardable

            note_unguardable("loops", "PhiML while_loop")
            return original(self_, loop, values, max_iter)

        TorchBackend.while_loop = while_loop

    def remove(self) -> None:
        from phiml.backend.torch._torch_backend import TorchBackend

        TorchBackend.while_loop = self.original


_LOOP_PATCH = _WhileLoop()
LOOPS = RefCounted(_LOOP_PATCH.install, _LOOP_PATCH.remove)


class _SparseCoo:
    """``TorchBackend.sparse_coo_tensor`` without ``torch.jit.script`` unless TorchScript traces.

    PhiML scripts a helper on every call so that a TorchScript trace does not bake the sparse
    matrix as a constant. Our passes and PhiML forwards (record, graph capture, bodies run as
    Python) need no TorchScript (engine "auto" runs none): the matrix is built directly, as the
    helper builds it; under a TorchScript trace (engine "torchscript") PhiML's own runs."""

    def __init__(self) -> None:
        self.original: Any = None

    def install(self) -> None:
        from phiml.backend.torch._torch_backend import TorchBackend, to_torch_dtype

        original = self.original = TorchBackend.__dict__["sparse_coo_tensor"]

        def sparse_coo_tensor(self_: Any, indices: Any, values: Any, shape: Any) -> Any:
            if get_tracing_state() is not None:
                return original(self_, indices, values, shape)
            indices = self_.transpose(self_.to_int64(indices), [1, 0])
            (values,) = self_.auto_cast(values)
            size = torch.Size([int(shape[0]), int(shape[1])])
            dtype = to_torch_dtype(self_.float_type)
            return torch.sparse_coo_tensor(indices, values, size=size, dtype=dtype)

        TorchBackend.sparse_coo_tensor = sparse_coo_tensor

    def remove(self) -> None:
        from phiml.backend.torch._torch_backend import TorchBackend

        TorchBackend.sparse_coo_tensor = self.original


_SPARSE_COO_PATCH = _SparseCoo()
SPARSE_COO = RefCounted(_SPARSE_COO_PATCH.install, _SPARSE_COO_PATCH.remove)
