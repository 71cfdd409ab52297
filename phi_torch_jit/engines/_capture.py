"""The capture step of engines ``"compile"`` and ``"auto"``: the wrapper module as an FX graph.

The wrapper module is run once under ``make_fx`` on real tensors, with the parameters and
buffers of the recorded modules passed as extra inputs. The replay cursor is active as for
any trace, so each custom call appears as one node of its ``phi_torch_jit::`` op; the Python
of the user function, the modules and their hooks is gone from the graph.

Contract: :func:`capture` returns the graph of ``(*example_inputs, *state) -> outputs``, its
meta :data:`WITHOUT_GRAD` naming the outputs eager returns without autograd history, and
raises where a captured graph would not be faithful: :class:`~phi_torch_jit.errors.TraceError`
for a captured tensor that requires grad, :class:`~phi_torch_jit.errors.ValueNotCaptured` for
a tensor read as a size, :class:`~phi_torch_jit.errors.RunEagerly` for what must run eagerly.
The caller holds :data:`CAPTURE_LOCK`. Nothing here compiles: the backend's part is
:mod:`.compile`'s.
"""

from __future__ import annotations

import torch
from torch import nn

from .._compat import VALUE_OUT_OF_GRAPH, around_cpp_builds
from .._fast_capture import fast_metadata
from .._inner_grad import functional_autograd
from .._rnn_layers import split_rnn_dropout
from ..errors import RunEagerly, TraceError, ValueNotCaptured
from ._generic_sizes import generic_graph
from ._graph_bodies import data_dependent_shape
from ._merge_repeated import merge_repeated_ops
from ._tracing_lock import TracingLock
from .base import RANDOM_OPS, captured_tensor_message

__all__ = ["CAPTURE_LOCK", "WITHOUT_GRAD", "capture", "uses_rng"]

CAPTURE_LOCK = TracingLock()
"""Held while FX traces: a capture, a backend's compile (FX tracing keeps process-wide state;
NOTE [one tracing thread]); lent during inductor's C++ builds (:mod:`._tracing_lock`)."""
around_cpp_builds(CAPTURE_LOCK.lent)

WITHOUT_GRAD = "phi_torch_jit.without_grad"
"""Graph meta: the outputs that needed no gradient when captured (detached, computed under
``no_grad``, a gradient taken with ``create_graph=False``)."""


def capture(
    module: nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    state: tuple[torch.Tensor, ...],
    label: str,
) -> torch.fx.GraphModule:
    """The wrapper's forward as an FX graph of (inputs, parameters and buffers)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    n = len(example_inputs)
    without_grad: list[int] = []

    def flat(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = tuple(module(*tensors[:n]))
        if torch.is_grad_enabled():
            without_grad[:] = [i for i, t in enumerate(outputs)
                               if isinstance(t, torch.Tensor) and not t.requires_grad]  # fmt: skip
        return outputs

    try:
        with fast_metadata(), functional_autograd() as gradients:
            graph = make_fx(flat, tracing_mode="real", pre_dispatch=True)(*example_inputs, *state)
    except RuntimeError as error:
        if VALUE_OUT_OF_GRAPH not in str(error):
            raise
        raise ValueNotCaptured(
            "a tensor is read as a Python value that a captured graph (engines 'compile', "
            "'auto') cannot hold (a tensor used as a size, e.g. torch.ones(n) or "
            "x.repeat(n)); pass it as an int, or use engine 'torchscript'"
        ) from None
    if gradients.count and merge_repeated_ops(graph.graph):  # before AOTAutograd sees it
        graph.recompile()
    graph.meta[WITHOUT_GRAD] = tuple(without_grad)
    _reject_captured(graph, label)
    _reject_data_dependent_shapes(graph)
    graph = generic_graph(graph, (*example_inputs, *state), label) or graph
    split_rnn_dropout(graph)
    return graph


def uses_rng(graph: torch.fx.GraphModule) -> bool:
    """Whether the captured graph may draw random numbers (our ops count as may)."""
    for node in graph.graph.nodes:
        if node.op == "call_function":
            name = str(node.target)
            if name.startswith("phi_torch_jit") or any(r in name for r in RANDOM_OPS):
                return True
    return False


def _reject_data_dependent_shapes(graph: torch.fx.GraphModule) -> None:
    """A captured graph has the shapes of this run baked in; an op whose output shape depends
    on values would give other calls wrong sizes. Boolean indices, ``nonzero``,
    ``torch.where(mask)``, ``masked_select``, ``repeat_interleave``, ``unique`` of integers and
    ``bincount`` reach the graph in a static form with their sizes guarded (NOTE
    [value-dependent sizes]); what is left here (``unique`` of floats, ``bincount`` with
    weights that require grad, ``unique_consecutive``, such an op in torch's own code with
    guards off) runs eagerly."""
    name = data_dependent_shape(graph)
    if name:
        raise RunEagerly(
            "a captured graph (engines 'compile', 'auto') would bake the output shape of "
            f"{name} (it depends on tensor values); use ops with static shapes (torch.where "
            "with three arguments, nonzero_static, index_add into zeros), or engine "
            "'torchscript'"
        )


def _reject_captured(graph: torch.fx.GraphModule, label: str) -> None:
    """Tensors that require grad but are neither inputs nor module state would lose gradients."""
    for node in graph.graph.nodes:
        if node.op == "get_attr":
            value = getattr(graph, node.target, None)
            if isinstance(value, torch.Tensor) and value.requires_grad:
                raise TraceError(captured_tensor_message(label))
