"""Captured graphs whose value-dependent sizes stay dynamic (engines "compile" and "auto").

A captured graph holds ``nonzero``, a boolean index, ``masked_select`` and
``repeat_interleave`` in a static form, for the size the traced call produced, with that size
guarded (:mod:`.._static_shapes`): right for one size, retraced for each other. Where the traced
Python never read such a size (:mod:`.._value_sized` watched), the only way the graph can
depend on it is through its own ops: a literal size that torch's C++ computed while tracing
(``reshape`` of an index tensor records the count it saw). :func:`generic_graph` puts the ops
back in their dynamic form (``nonzero_static(m, size=K)`` becomes ``nonzero(m)``) and runs the
graph on fake tensors whose value-dependent sizes are symbols: if any op needs to know a
symbol's value (a literal size meets a dynamic one), the graph is not generic and the static
form stays, guarded as before. If it runs through, the graph is right for every size, and the
size guards are dropped (the engine's result says ``sizes_left_dynamic``): a program whose
counts change on every call is compiled once per path. The check runs outside the trace's
patches (``no_frame``: our own make_fx hook would take the copy's ops for the user's).
NOTE [value-dependent sizes].
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from .._compat import FAKE_MODE, SHAPE_ENV
from .._context import no_frame
from .._value_sized import SIZED_NODE

__all__ = ["GENERIC_SIZES", "fake_inputs_for", "generic_graph", "sizes_left_dynamic"]

logger = logging.getLogger("phi_torch_jit")

aten = torch.ops.aten

GENERIC_SIZES = "phi_torch_jit.generic_sizes"
"""Graph meta: True where the graph computes value-dependent sizes itself (its backend must be
given fake inputs with a shape environment)."""


def _dynamic_form(node: torch.fx.Node) -> None:
    if node.target is aten.nonzero_static.default:
        node.target = aten.nonzero.default
        node.args, node.kwargs = node.args[:1], {}
    else:  # repeat_interleave traced with output_size
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "output_size"}


def _runs_symbolically(graph: torch.fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> str:
    """Why ``graph`` cannot run with its value-dependent sizes as symbols ("" if it can)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    # constants of the graph (get_attr tensors) are real; they take part as they are
    fake_mode = FAKE_MODE.find()(shape_env=SHAPE_ENV.find()(), allow_non_fake_inputs=True)
    # Outside the trace's patches; traced as AOTAutograd will see it (pre-dispatch: a plain
    # run of some ops, addcmul, takes their C++ kernel, which wants concrete sizes).
    try:
        with no_frame(), fake_mode:
            fakes = [fake_mode.from_tensor(t, static_shapes=True) for t in inputs]
            make_fx(graph, tracing_mode="real", pre_dispatch=True)(*fakes)
    except Exception as error:  # any op that needed a size's value
        return f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
    asserts = getattr(fake_mode.shape_env, "deferred_runtime_asserts", {})
    if any(asserts.values()):
        return f"checks a size at run time ({next(a for a in asserts.values() if a)})"
    return ""


def generic_graph(
    graph: torch.fx.GraphModule, inputs: tuple[torch.Tensor, ...], label: str
) -> torch.fx.GraphModule | None:
    """``graph`` with its static forms put back in their dynamic form, if that is right for
    every size (see the module docstring), with meta :data:`GENERIC_SIZES`; None if not, or if
    it has none. The trace told which nodes hold sizes, and whether Python read one, in their
    meta (:data:`.._value_sized.SIZED_NODE`)."""
    sized = [n for n in graph.graph.nodes if SIZED_NODE in n.meta]
    if not sized:
        return None
    read = next((n.meta[SIZED_NODE] for n in sized if n.meta[SIZED_NODE]), "")
    why = f"Python read one at {read}" if read else ""
    if not why:
        generic = torch.fx.GraphModule(graph, copy.deepcopy(graph.graph))
        for node in generic.graph.nodes:
            if SIZED_NODE in node.meta:
                _dynamic_form(node)
        generic.recompile()
        why = _runs_symbolically(generic, inputs)
    if why:
        logger.debug("phi_torch_jit: %s: value-dependent sizes stay guarded: %s", label, why)
        return None
    generic.meta.update(graph.meta)
    generic.meta[GENERIC_SIZES] = True
    return generic


def sizes_left_dynamic(graph: torch.fx.GraphModule) -> bool:
    """Whether ``graph`` is a :func:`generic_graph` (the engine says so in its result)."""
    return bool(graph.meta.get(GENERIC_SIZES))


def fake_inputs_for(graph: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> list[Any] | None:
    """Fake inputs with a shape environment for a generic graph's backend (None: not one)."""
    if not sizes_left_dynamic(graph):
        return None
    fake_mode = FAKE_MODE.find()(shape_env=SHAPE_ENV.find()())
    return [fake_mode.from_tensor(t, static_shapes=True) for t in inputs]
