"""Which captured graphs inductor's on-disk caches hold, remembered across processes.

Inductor keeps what it compiled (its FX graph cache and AOTAutograd's cache, in
``TORCHINDUCTOR_CACHE_DIR``): a second process compiling the same graph loads the program
instead, in 0.2-1 s rather than 10-130 s. Engine "auto" cannot ask inductor beforehand whether
a compile will be a load, so after each inductor compile it writes the graph's fingerprint
(:func:`fingerprint`: the graph's code, its inputs' metadata, the grad mode, the settings,
torch's version) into the same directory (:func:`remember`). A later process whose captured
graph has a remembered fingerprint (:func:`remembered`) queues the load at the first call and
waits for it at the next one (``engines.auto``, :data:`WARM_WAIT_S`): from its second call on,
a warm start serves the compiled program, where a cold one serves the fast tier while the
compile runs.

The fingerprint only predicts; inductor's own keys decide what is loaded. A wrong prediction
(a cache emptied since, settings that differ where the fingerprint cannot see) costs the
second call at most :data:`WARM_WAIT_S` of waiting; the compile goes on in the background and
the fast tier serves meanwhile, as on a cold start.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from .._compat import inductor_cache_dir, inductor_caches_on

__all__ = ["CompileTarget", "fingerprint", "remember", "remembered", "await_loads", "WARM_WAIT_S"]

WARM_WAIT_S = 5.0
"""How long a warm start's second call waits for the load of a remembered program; past it the
call runs on the fast tier and the load goes on in the background."""

_logger = logging.getLogger("phi_torch_jit")


class CompileTarget(Protocol):
    """What a backend's compile of a captured graph is made of (``engines.compile.Compilable``)."""

    graph: torch.fx.GraphModule
    backend: Any
    settings: Any
    grad_enabled: bool
    metas: list[tuple[Any, ...]]


def fingerprint(target: CompileTarget) -> str | None:
    """The fingerprint of an inductor compile of ``target``; None for other backends and where
    inductor's caches are off (nothing is kept then). Computed once per target and kept on
    it (``fingerprint_key``): a compile in a worker process replaces the target's graph by one
    loaded from a pickle, whose code differs (``engines._compile_process``), and the key must
    stay the one a later process computes from its own capture."""
    if target.backend != "inductor" or not inductor_caches_on():
        return None
    key = getattr(target, "fingerprint_key", None)
    if key is None:
        key = _fingerprint(target)
        try:
            target.fingerprint_key = key  # type: ignore[attr-defined]
        except AttributeError:  # a target that keeps no attributes: computed each time
            pass
    return key


def _fingerprint(target: CompileTarget) -> str:
    constants = sorted(
        (name, tuple(value.shape), str(value.dtype), str(value.device))
        for name, value in _tensor_attributes(target.graph)
    )
    parts = (
        torch.__version__,
        target.graph.code,
        constants,
        [tuple(map(str, meta)) for meta in target.metas],
        target.grad_enabled,
        sorted(map(repr, dict(target.settings).items())),
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def _tensor_attributes(graph: torch.fx.GraphModule) -> list[tuple[str, torch.Tensor]]:
    found = []
    for node in graph.graph.nodes:
        if node.op == "get_attr":
            value: Any = graph
            for part in str(node.target).split("."):
                value = getattr(value, part, None)
            if isinstance(value, torch.Tensor):
                found.append((str(node.target), value))
    return found


def await_loads(program: threading.Event, blocks: Sequence[Any]) -> None:
    """Wait for a warm start's loads: the program's (``program`` set when it ended) and those
    of the blocks (``engines._block_tiers``) inductor's caches hold, :data:`WARM_WAIT_S` at
    most in all."""
    deadline = time.monotonic() + WARM_WAIT_S
    program.wait(WARM_WAIT_S)
    for block in blocks:
        if block.remembered:
            block.settled.wait(max(0.0, deadline - time.monotonic()))


def _marker(key: str) -> Path:
    return Path(inductor_cache_dir()) / "phi_torch_jit" / "compiled" / key


def remembered(target: CompileTarget) -> bool:
    """Whether inductor compiled this graph before in this cache directory (any process)."""
    key = fingerprint(target)
    try:
        return key is not None and _marker(key).exists()
    except OSError:  # a cache directory that cannot be made: nothing was kept there
        return False


def remember(target: CompileTarget) -> None:
    """After an inductor compile of ``target``: its program is in inductor's caches now."""
    key = fingerprint(target)
    if key is None:
        return
    try:
        marker = _marker(key)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError as error:  # a read-only cache directory: warm starts are only slower
        _logger.debug("phi_torch_jit: could not remember a compile: %s", error)


def forget_all() -> None:
    """Forget every remembered compile of this cache directory (tests)."""
    folder = _marker("x").parent
    if folder.is_dir():
        for marker in folder.iterdir():
            os.unlink(marker)
