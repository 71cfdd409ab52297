"""Stage 1 (record): torch's fast paths, which a captured program does not take.

``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` and ``nn.TransformerEncoder`` in
eval mode, without autograd, run fused kernels (``torch._native_multi_head_attention``; nested
tensors for a padding mask) where ``torch.overrides.has_torch_function(tensor_args)`` is
False. Their values differ from the composite path's: a fully masked row gives NaN on one and
0 on the other, padded positions are zeros on the nested path. The record pass's
torch-function mode made that check True, so the record pass took the composite path, and
every engine compiled it: silently not what eager code computes, from the first call (probe
42b). While a record pass runs, the check answers for torch's ``nn`` modules as it would
without our mode; where the fast path would then be taken (autograd off, or nothing requiring
grad), the record pass takes it too and notes it, and the specialization runs eagerly, warned.
A step that turns the fast path off (``torch.backends.mha.set_fastpath_enabled(False)``)
never reaches the check and is compiled.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn

from ._compat import DISABLED_TORCH_FUNCTION
from ._patches import RefCounted
from ._sources import TORCH_DIR
from ._watched_calls import note, recording_notes, user_line

__all__ = ["FAST_PATHS"]

_NN_MODULES = os.path.join(TORCH_DIR, "nn", "modules") + os.sep
_ORIGINAL = torch.overrides.has_torch_function


def _overridden(value: Any) -> bool:
    """Whether ``value`` has a ``__torch_function__`` of its own class (a tensor subclass),
    as torch's check sees it with no mode active."""
    if type(value) in (torch.Tensor, nn.Parameter):
        return False
    method = getattr(type(value), "__torch_function__", None)
    return method is not None and method is not DISABLED_TORCH_FUNCTION.find()


def _has_torch_function(relevant_args: Any) -> bool:
    answer: bool = _ORIGINAL(relevant_args)
    if not answer or recording_notes() is None:
        return answer
    caller = sys._getframe(1)
    if not caller.f_code.co_filename.startswith(_NN_MODULES):
        return answer
    args = tuple(relevant_args)
    if any(_overridden(a) for a in args):
        return True
    grad = torch.is_grad_enabled()
    if not (grad and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
        owner = getattr(caller.f_code, "co_qualname", caller.f_code.co_name).split(".")[0]
        note("fast_paths", f"{owner} at {user_line(caller)}")
    return False


def _install() -> None:
    torch.overrides.has_torch_function = _has_torch_function  # type: ignore[assignment]


def _remove() -> None:
    if torch.overrides.has_torch_function is _has_torch_function:  # else someone else's
        torch.overrides.has_torch_function = _ORIGINAL


FAST_PATHS = RefCounted(_install, _remove)
"""The record phase's patch of torch's fast-path check (see the module's docstring)."""
