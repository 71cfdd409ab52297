"""The phases' watches: the functions the record pass wraps to note calls that no compiled
program repeats (random draws, clocks, entropy, files, seeds, grad mode, tensor hooks,
autograd and torch.func transforms inside the step), by owner and name (``_unguardable``
installs the wrappers)."""

from __future__ import annotations

import builtins
import io
import os
import pathlib
import random
import sys
import time
from typing import Any

import torch

from ._compat import grad_mode_setter

__all__ = ["watched_calls"]


def watched_calls() -> list[tuple[Any, str, str, str]]:
    """(owner, attribute, kind, label) of every function the record pass watches."""
    targets: list[tuple[Any, str, str, str]] = []
    names = [n for n in random.__all__ if callable(getattr(random, n, None))]
    targets += [(random, n, "random", f"random.{n}") for n in names if n[0].islower()]
    methods = [n for n in dir(random.Random) if n[0].islower() and n not in ("getstate",)]
    targets += [(random.Random, n, "random", f"random.Random.{n}") for n in methods]
    targets += [(builtins, "open", "files", "open"), (io, "open", "files", "io.open")]
    targets += [
        (pathlib.Path, n, "files", f"Path.{n}") for n in ("read_text", "read_bytes", "open")
    ]
    clocks = ("time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns")
    targets += [(time, n, "random", f"time.{n}") for n in clocks]
    # entropy: uuid4, secrets, SystemRandom (which calls random's own name for it)
    targets += [(os, "urandom", "random", "os.urandom"),
                (random, "_urandom", "random", "os.urandom")]  # fmt: skip
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        legacy = [n for n in dir(numpy.random) if n[0].islower() and n not in _NUMPY_KEEP]
        targets += [(numpy.random, n, "random", f"numpy.random.{n}") for n in legacy
                    if callable(getattr(numpy.random, n))]  # fmt: skip
    for owner in (torch, torch.random):
        targets += [(owner, n, "random", f"torch.{n}") for n in _TORCH_RNG if hasattr(owner, n)]
    targets.append((*grad_mode_setter(), "grad_mode", ""))
    targets.append((torch.Tensor, "register_hook", "tensor_hooks", "Tensor.register_hook"))
    hooks = torch.autograd.graph.saved_tensors_hooks
    targets.append((hooks, "__enter__", "saved_hooks", "saved-tensor hooks"))
    # a new alias made without an op, as .data is: a trace would bake it as a constant
    targets.append((torch.Tensor, "as_subclass", "data", "Tensor.as_subclass"))
    targets.append((torch.Tensor, "set_", "data", "Tensor.set_"))  # swaps storage, as .data =
    for owner in (torch, torch.utils.dlpack):  # a tensor sharing another's memory, made by no op
        targets.append((owner, "from_dlpack", "data", "torch.from_dlpack"))
    # Tensor.backward calls torch.autograd.backward
    targets.append((torch.autograd, "grad", "gradients", "torch.autograd.grad"))
    targets.append((torch.autograd, "backward", "autograd", "torch.autograd.backward"))
    for owner, prefix in ((torch.func, "torch.func"), (torch, "torch")):
        targets += [(owner, n, "functorch", f"{prefix}.{n}") for n in _TRANSFORMS
                    if owner.__dict__.get(n) is not None]  # fmt: skip
    return targets


_NUMPY_KEEP = frozenset(("default_rng", "get_state", "bit_generator", "test"))
_TORCH_RNG = ("manual_seed", "seed", "set_rng_state", "initial_seed", "get_rng_state")
_TRANSFORMS = ("vmap", "grad", "grad_and_value", "jacrev", "jacfwd", "hessian", "vjp", "jvp")
