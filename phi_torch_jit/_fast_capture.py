"""make_fx on real tensors without a new FakeTensorMode for every op.

make_fx keeps each node's metadata (``meta["val"]``) as a fake tensor. For a real tensor
(``tracing_mode="real"``, how every capture here runs), torch 2.11-2.15 builds a new
``FakeTensorMode`` for each op output, and that constructor records a stack trace: profiled,
0.4 s of the 0.9 s capture of a PhiML CG block's 448 ops, and as much again in the capture of
the PhiFlow step around it. While one of our captures runs, the metadata of real tensors is made
by one mode per thread instead: the same shape, strides, dtype and device, without the stack.
Anything else (fake tensors, symbolic values, sparse tensors) goes to torch's own function.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ._compat import FAKE_MODE, PROXY_TENSOR
from ._patches import RefCounted

__all__ = ["fast_metadata"]


class _Modes(threading.local):
    mode: Any = None


_MODES = _Modes()


def _shared_mode() -> Any:
    mode = _MODES.mode
    if mode is None:
        mode = _MODES.mode = FAKE_MODE.find()(allow_fallback_kernels=True)
    return mode


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _fast(original: Callable[..., Any]) -> Callable[..., Any]:
    def extract_val(val: Any, include_real: bool = False) -> Any:
        if type(val) not in _PLAIN or val.is_sparse:  # other subclasses (fakes): torch's way
            return original(val, include_real)
        with _shared_mode():
            return torch.empty_strided(val.shape, val.stride(), device=val.device, dtype=val.dtype)

    extract_val.__wrapped__ = original  # type: ignore[attr-defined]
    return extract_val


def _install() -> None:
    module = PROXY_TENSOR.find()
    module.extract_val = _fast(module.extract_val)


def _remove() -> None:
    module = PROXY_TENSOR.find()
    module.extract_val = module.extract_val.__wrapped__


_PATCH = RefCounted(_install, _remove)


@contextmanager
def fast_metadata() -> Iterator[None]:
    """Run a real-tensor make_fx capture with the shared metadata mode (see the module)."""
    with _PATCH.active():
        yield
