"""Stage 2 (trace): ``torch.autograd.grad`` inside the step, captured as ops of the program.

Forces (``-grad(E, pos, create_graph=True)``), PINN residuals and Hamiltonian flows take a
gradient inside the step, and the training loss differentiates it again. make_fx sees the ops
the autograd engine runs, but not how they depend on the forward: a pre-dispatch capture (how
:mod:`.engines.compile` captures) keeps the activations the backward saved as constants, a
post-dispatch one feeds them through ``detach``; the values are right, the second derivative
is not (measured in ../shared/FACTS.md). See NOTE [autograd inside the step] in docs/design.md.

While :func:`functional_autograd` is active on the capturing thread, every run of the autograd
engine (``torch.autograd.grad`` under any name it was imported by, ``torch.autograd.functional``)
is replaced by :func:`_captured_gradient`:

1. the ops between the differentiated inputs and the outputs are read back from the graph
   captured so far (a node whose value needs no gradient, e.g. under ``no_grad`` or after
   ``detach``, is cut there: it enters as a constant, as in eager autograd);
2. their vector-Jacobian product is traced by a separate make_fx of ``torch.func.vjp`` over
   those ops, on copies: a graph of forward and backward ops as functions of their inputs;
3. that graph's ops are replayed in the capture on the real tensors, so the gradient is part
   of the program as ordinary differentiable ops (the forward's ops appear twice; AOTAutograd's
   common-subexpression pass merges them).

With ``create_graph=False`` the gradients are detached, as eager returns them. Refused, so that
the step runs eagerly with its warning (:class:`RunEagerly`): ``backward()`` (it writes
``.grad`` of tensors the caller owns), ops on the way that draw random numbers or write in
place (a replay would draw or write again), ops that are neither ATen's nor a custom function's
(captured loops), inputs of which one is computed from another, batched gradients, tensors
with a hook on the way (``weight.register_hook(...)``: eager autograd runs it). A custom
function's op is differentiated by the function's own backward, run as Python while the
product is traced (:mod:`._own_backward`); where the gradient is differentiated again
(``create_graph=True``), one whose backward computes with grad mode off is refused.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeGuard

import torch
import torch.fx

from ._compat import ENGINE_RUN_BACKWARD, PROXY_TENSOR, grad_mode_setter, op_overload
from ._own_backward import PYTHON_VJPS, OwnBackward, differentiated_again
from ._patches import RefCounted
from ._rnn_layers import RNN_OPS, rnn_dropout
from .errors import RunEagerly

__all__ = ["functional_autograd", "GradientsCaptured"]


class _State(threading.local):
    active = False
    """This thread is capturing: autograd runs are traced functionally."""
    busy = False
    """A gradient graph is being built (torch.func.vjp runs the engine itself)."""
    grad_mode = True
    """The grad mode the capture started in (before any ``_set_grad_enabled`` node)."""
    captured: GradientsCaptured | None = None
    """Counts the autograd runs captured in the active block."""


_STATE = _State()
_ORIGINAL: list[Callable[..., Any]] = []


_ENGINE_RUN = ENGINE_RUN_BACKWARD.names[0].rpartition(".")[2]
"""Its name in ``torch.autograd``, where ``grad`` and ``backward`` look it up."""


def _install() -> None:
    _ORIGINAL.append(ENGINE_RUN_BACKWARD.find())
    setattr(torch.autograd, _ENGINE_RUN, _dispatch)


def _remove() -> None:
    setattr(torch.autograd, _ENGINE_RUN, _ORIGINAL.pop())


def _set_grad_enabled() -> Any:
    owner, name = grad_mode_setter()
    return getattr(owner, name)


_PATCH = RefCounted(_install, _remove)


@contextmanager
def functional_autograd() -> Iterator[GradientsCaptured]:
    """Capture autograd runs of this thread as ops of the graph make_fx is tracing (see the
    module); other threads' autograd runs as before. Yields how many were captured."""
    captured = GradientsCaptured()
    with _PATCH.active():
        previous = _STATE.active, _STATE.grad_mode, _STATE.captured
        _STATE.active, _STATE.grad_mode = True, torch.is_grad_enabled()
        _STATE.captured = captured
        try:
            yield captured
        finally:
            _STATE.active, _STATE.grad_mode, _STATE.captured = previous


class GradientsCaptured:
    """How many autograd runs a :func:`functional_autograd` block captured."""

    def __init__(self) -> None:
        self.count = 0


def _dispatch(outputs: Any, *args: Any, **kwargs: Any) -> Any:
    original = _ORIGINAL[0] if _ORIGINAL else ENGINE_RUN_BACKWARD.find()
    if not _STATE.active or _STATE.busy:
        return original(outputs, *args, **kwargs)
    mode = PROXY_TENSOR.find().get_proxy_mode()
    if mode is None:
        return original(outputs, *args, **kwargs)
    if _STATE.captured is not None:
        _STATE.captured.count += 1
    return _captured_gradient(mode.tracer, outputs, *args, **kwargs)


def _captured_gradient(
    tracer: Any,
    outputs: Sequence[Any],
    grad_outputs: Sequence[torch.Tensor | None],
    retain_graph: bool | None,
    create_graph: bool,
    inputs: Sequence[Any] = (),
    allow_unused: bool = False,
    accumulate_grad: bool = True,
) -> tuple[torch.Tensor | None, ...]:
    if accumulate_grad or not inputs:
        raise RunEagerly(
            "it calls backward() inside the function, which writes .grad of tensors the "
            "caller owns; return the loss and call backward() outside the jitted function, or "
            "use torch.autograd.grad (captured)"
        )
    graph = _Subgraph(tracer, outputs, inputs)
    # create_graph builds the gradient's graph even under no_grad, as eager's engine does
    with differentiated_again(bool(create_graph)), _grad_mode(tracer, bool(create_graph)):
        gradients = graph.vjp([_ones_if_none(g, o) for g, o in zip(grad_outputs, outputs)])
    if not create_graph:
        gradients = [g.detach() for g in gradients]
    reached = iter(gradients)
    return tuple(next(reached) if used else None for used in graph.used)


@contextmanager
def _grad_mode(tracer: Any, on: bool) -> Iterator[None]:
    """Grad mode on while the block runs if ``on`` (else unchanged), recorded in the capture:
    the capture's own recording of grad-mode changes is off inside the autograd call."""
    previous = torch.is_grad_enabled()
    if not on or previous:
        yield
        return
    set_grad_enabled = _set_grad_enabled()
    tracer.graph.call_function(set_grad_enabled, (True,))
    torch.set_grad_enabled(True)
    try:
        yield
    finally:
        tracer.graph.call_function(set_grad_enabled, (False,))
        torch.set_grad_enabled(False)


def _ones_if_none(gradient: torch.Tensor | None, output: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(output) if gradient is None else gradient


class _Subgraph:
    """The captured ops from ``inputs`` to ``outputs`` (see the module's step 1)."""

    def __init__(self, tracer: Any, outputs: Sequence[Any], inputs: Sequence[Any]) -> None:
        self.tracer = tracer
        self.outputs = [self._node(t) for t in outputs]
        self.inputs = [self._node(t) for t in inputs]
        self.live = {slot.proxy.node: t for t, slot in tracer.tensor_tracker.items()}
        needs_grad = self._needs_grad()
        ancestors: set[torch.fx.Node] = set()
        stack = list(self.outputs)
        while stack:
            node = stack.pop()
            if node in ancestors:
                continue
            ancestors.add(node)
            if node not in self.inputs and needs_grad.get(node, False):
                stack += node.all_input_nodes
        reached = [n for n in self.inputs if n in ancestors]
        self.used = [n in ancestors for n in self.inputs]
        if len(set(reached)) != len(reached) or any(
            other is not node and self._depends(node, other)
            for node in reached
            for other in reached
        ):
            raise RunEagerly(
                "it takes torch.autograd.grad with respect to tensors of which one is computed "
                "from another (or one twice), which the captured gradient does not split"
            )
        self.reached = reached
        hooked = [self.live[n] for n in ancestors if _hooked(self.live.get(n))]
        if hooked:  # a parameter's weight.register_hook(...): eager autograd runs it
            raise RunEagerly(
                f"it takes torch.autograd.grad through a tensor with a hook (register_hook, on "
                f"a tensor of shape {tuple(hooked[0].shape)}), which the captured gradient "
                "would not run; remove the hook or apply it to the gradient in the function"
            )
        inner = [n for n in tracer.graph.nodes if n in ancestors and n not in reached]
        self.ops = [n for n in inner if n.op == "call_function" and needs_grad[n]]
        replayed = set(self.ops)
        self.constants = [n for n in inner if n not in replayed]
        for node in self.ops:
            _check_replayable(node)

    def _node(self, tensor: Any) -> torch.fx.Node:
        if not isinstance(tensor, torch.Tensor):
            raise RunEagerly(
                "it takes torch.autograd.grad of a GradientEdge, which the capture does not follow"
            )
        proxy_tensor = PROXY_TENSOR.find()
        if not proxy_tensor.has_proxy_slot(tensor, self.tracer):
            raise RunEagerly(
                "it takes torch.autograd.grad of tensors the capture does not see (batched "
                "gradients, or tensors made outside the traced function)"
            )
        node: torch.fx.Node = proxy_tensor.get_proxy_slot(tensor, self.tracer).proxy.node
        return node

    def _needs_grad(self) -> dict[torch.fx.Node, bool]:
        """Whether eager autograd would differentiate through each node's value: a live tensor
        says so itself; a released one is judged as autograd does (grad mode on, an input that
        needs it, a floating or complex result, not ``detach``)."""
        grad_mode = _STATE.grad_mode
        set_grad_enabled = _set_grad_enabled()
        modes: list[bool] = []
        needs: dict[torch.fx.Node, bool] = {}
        for node in self.tracer.graph.nodes:
            if node.target is set_grad_enabled:
                modes.append(bool(node.args[0]))
            live = self.live.get(node)
            if isinstance(live, torch.Tensor):
                needs[node] = live.requires_grad
            elif node.op == "call_function" and node.target not in _CUTS:
                floating = _differentiable(node.meta.get("val"))
                mode = modes[-1] if modes else grad_mode
                needs[node] = (
                    mode and floating and any(needs.get(a, False) for a in node.all_input_nodes)
                )
            else:
                needs[node] = False
        for node in self.inputs:
            needs[node] = True
        return needs

    def _depends(self, node: torch.fx.Node, other: torch.fx.Node) -> bool:
        """Whether ``node`` is computed from ``other``."""
        stack, seen = list(node.all_input_nodes), set()
        while stack:
            current = stack.pop()
            if current is other:
                return True
            if current not in seen:
                seen.add(current)
                stack += current.all_input_nodes
        return False

    def _value(self, node: torch.fx.Node) -> Any:
        """The value of a node the gradient takes as a constant. One the step computed and
        released already (``kinds[src]`` reshaped inside a library's layer) is computed again
        from its own inputs, recorded in the capture (the same values: its ops are pure and
        draw no random numbers; the backend's common-subexpression pass merges them)."""
        if node in self.live:
            return self.live[node]
        if node.op == "get_attr":
            return getattr(self.tracer.root, node.target)  # type: ignore[arg-type]
        if node.op == "call_function" and _recomputable(node.target):
            args = torch.fx.node.map_arg(node.args, self._value)
            kwargs = torch.fx.node.map_arg(node.kwargs, self._value)
            value = node.target(*args, **kwargs)  # type: ignore[operator]
            if isinstance(value, torch.Tensor) and value.requires_grad:
                value = value.detach()  # it needed no gradient (no_grad, a cut): a constant
            self.live[node] = value
            return value
        raise RunEagerly(
            f"it takes torch.autograd.grad through a value the capture no longer holds ({node})"
        )

    def _replay(self, inputs: Sequence[torch.Tensor], constants: Sequence[Any]) -> tuple[Any, ...]:
        env: dict[torch.fx.Node, Any] = dict(zip(self.reached, inputs))
        env.update(zip(self.constants, constants))
        for node in self.ops:
            args = torch.fx.node.map_arg(node.args, env.__getitem__)
            kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
            vjp = PYTHON_VJPS.get(node.target)
            if vjp is not None:  # a custom function: its own backward, traced as ops
                env[node] = OwnBackward.apply(node.target, vjp, *args)
            else:
                env[node] = node.target(*args, **kwargs)  # type: ignore[operator]
        return tuple(env[n] for n in self.outputs)

    def vjp(self, grad_outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients of the reached inputs, as ops recorded in the running capture."""
        inputs = [self.live[n] for n in self.reached]
        constants = [self._value(n) for n in self.constants]
        make_fx = PROXY_TENSOR.find().make_fx

        def joint(inputs: list[Any], constants: list[Any], cotangents: list[Any]) -> Any:
            pullback = torch.func.vjp(lambda *x: self._replay(x, constants), *inputs)[1]
            return list(pullback(tuple(cotangents)))

        before = set(self.tracer.graph.nodes)
        _STATE.busy = True
        try:
            with PROXY_TENSOR.find().disable_proxy_modes_tracing():
                copies = [[_copy(t) for t in part] for part in (inputs, constants, grad_outputs)]
                built = make_fx(joint, tracing_mode="real")(*copies)
        finally:
            _STATE.busy = False
        set_grad_enabled = _set_grad_enabled()
        for node in list(self.tracer.graph.nodes):  # grad-mode no-ops of the nested trace
            if node not in before and node.target is set_grad_enabled and not node.users:
                self.tracer.graph.erase_node(node)
        return _run(built, [*inputs, *constants, *grad_outputs])


_CUTS = frozenset(
    op for op in (torch.ops.aten.detach.default, torch.ops.aten.alias.default) if op is not None
)
"""Ops whose result needs no gradient whatever their input."""


def _hooked(tensor: Any) -> bool:
    return bool(getattr(tensor, "_backward_hooks", None))


def _recomputable(target: Any) -> bool:
    """An op that gives the same values when run again: pure, not random."""
    if target is operator.getitem:
        return True
    return (
        _torchs_op(target)
        and not target._schema.is_mutable
        and torch.Tag.nondeterministic_seeded not in target.tags
    )


def _torchs_op(target: Any) -> TypeGuard[Any]:
    """An ATen or prims op (not ours, not a library's, not a Python callable)."""
    return isinstance(target, op_overload()) and target.namespace in ("aten", "prims")


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _differentiable(value: Any) -> bool:
    """A floating or complex tensor, or a tuple of results holding one (``max(dim)``, RNNs)."""
    if isinstance(value, (tuple, list)):
        return any(_differentiable(v) for v in value)
    return isinstance(value, torch.Tensor) and (
        value.dtype.is_floating_point or value.dtype.is_complex
    )


def _check_replayable(node: torch.fx.Node) -> None:
    target = node.target
    if target is operator.getitem or target in PYTHON_VJPS:  # a result of several; ours
        return
    if node.op != "call_function":
        raise RunEagerly(f"it takes torch.autograd.grad through {node.op} {target}")
    if not _torchs_op(target):
        raise RunEagerly(
            f"it takes torch.autograd.grad through {target}, which is not an ATen op (a captured "
            "loop, a custom function with a library's checks or a grad-mode change); "
            "differentiate outside it"
        )
    if target._schema.is_mutable:
        raise RunEagerly(
            f"it takes torch.autograd.grad through the in-place op {target}, which a captured "
            "gradient would run twice; use its out-of-place form"
        )
    random = torch.Tag.nondeterministic_seeded in target.tags and target not in RNN_OPS
    if random or rnn_dropout(node):
        raise RunEagerly(
            f"it takes torch.autograd.grad through the random op {target}, which a captured "
            "gradient would draw again"
        )


def _run(graph: torch.fx.GraphModule, values: list[Any]) -> list[torch.Tensor]:
    """Run ``graph``'s ops one by one, so that the running capture records them."""
    env: dict[torch.fx.Node, Any] = {}
    flat = iter(values)
    for node in graph.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(flat)
        elif node.op == "get_attr":
            env[node] = getattr(graph, node.target)  # type: ignore[arg-type]
        elif node.op == "call_function":
            args = torch.fx.node.map_arg(node.args, env.__getitem__)
            kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
            env[node] = node.target(*args, **kwargs)  # type: ignore[operator]
        elif node.op == "output":
            return list(torch.fx.node.map_arg(node.args[0], env.__getitem__))  # joint's list
    raise AssertionError("a graph without output")
