"""Which custom-function ops a CUDA graph may capture (``mode="reduce-overhead"``).

A CUDA graph records kernel launches once and replays them; anything that reads a value on
the host while recording (a solver's ``bool(rs > tol)``, a ``.item()``), compiles, or runs
Python that launches a different number of kernels per call cannot be recorded: the capture
fails ("operation not permitted when stream is capturing") and left torch's graph pool in a
state where every later capture in the process failed too ("already recording to mempool").

The decision, per op, from how its body was compiled:

* a forward **traced** faithfully (no Python control flow on values) is a fixed sequence of
  kernels: capturable, so it stays inside the graph;
* a forward that is **scripted**, **looped** (blocks with a host check each) or **python**
  reads values on the host: its op is tagged ``cudagraph_unsafe``, and inductor (with graph
  partitioning, which engine "compile" turns on with CUDA graphs) splits the program around
  it: the parts before and after are captured, the op runs between replays;
* a traced forward followed by convergence checks (PhiML's solves) reads on the host too;
* the **backward** op compiles on demand and runs the user's gradient: always tagged.

Only inductor reads the tags; on the CPU they change nothing. The decision is unit-tested on
the CPU (tests/test_graph_safety.py).
"""

from __future__ import annotations

from typing import Any

import torch

from .engines import Mode

__all__ = ["forward_tags", "backward_tags"]


def _unsafe() -> tuple[Any, ...]:
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)  # torch >= 2.8
    return (tag,) if tag is not None else ()


def forward_tags(mode: Mode, checks: bool) -> tuple[Any, ...]:
    """The tags of a custom function's forward op whose body was compiled as ``mode``;
    ``checks``: the op reads convergence values on the host after its body (PhiML's
    ``NotConverged``, NOTE [PhiML bridge])."""
    return () if mode == "traced" and not checks else _unsafe()


def backward_tags() -> tuple[Any, ...]:
    """The tags of a custom function's backward op (compiled on demand: never capturable)."""
    return _unsafe()
