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
size guards are dropped: a program whose counts change on every call is compiled once per path.
NOTE [value-dependent sizes].
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .._compat import FAKE_MODE, SHAPE_ENV
from .._context import current_frame, no_frame
from .._static_shapes import SIZED_NODE

__all__ = ["GENERIC_SIZES", "generic_graph"]

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
    graph: torch.fx.GraphModule, inputs: tuple[torch.Tensor, ...]
) -> torch.fx.GraphModule | None:
    """``graph`` with its static forms put back in their dynamic form, if that is right for
    every size (see the module docstring); None if not, or if it has none. The caller's trace
    frame is told (its size guards are then dropped)."""
    sized = [n for n in graph.graph.nodes if n.meta.get(SIZED_NODE)]
    frame = current_frame()
    if not sized or frame is None:
        return None
    if frame.sized.reads:
        logger.debug(
            "phi_torch_jit: %s: value-dependent sizes stay guarded: Python read one at %s",
            frame.owner, frame.sized.reads[0],
        )  # fmt: skip
        return None
    generic = torch.fx.GraphModule(graph, graph.graph)  # a copy of the module, same graph...
    generic.graph = _copied(graph.graph)  # ...and then a graph of its own
    for node in generic.graph.nodes:
        if node.meta.get(SIZED_NODE):
            _dynamic_form(node)
    generic.recompile()
    why = _runs_symbolically(generic, inputs)
    if why:
        logger.debug("phi_torch_jit: %s: value-dependent sizes stay guarded: %s", frame.owner, why)
        return None
    generic.meta.update(graph.meta)
    generic.meta[GENERIC_SIZES] = True
    frame.sized.generic = True
    return generic


def _copied(graph: torch.fx.Graph) -> torch.fx.Graph:
    copy = torch.fx.Graph()
    mapping: dict[torch.fx.Node, torch.fx.Node] = {}
    output = copy.graph_copy(graph, mapping)
    copy.output(output)
    return copy


def fake_inputs_for(graph: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> list[Any] | None:
    """Fake inputs with a shape environment for a generic graph's backend (None: not one)."""
    if not graph.meta.get(GENERIC_SIZES):
        return None
    fake_mode = FAKE_MODE.find()(shape_env=SHAPE_ENV.find()())
    return [fake_mode.from_tensor(t, static_shapes=True) for t in inputs]
