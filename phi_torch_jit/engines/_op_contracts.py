"""What a compile sees of a custom function's op, as one picklable record.

A recorded custom call becomes an op ``phi_torch_jit::<name>`` with a backward op
``<name>_bwd`` (``_custom_op.CompiledCall``). A compile never runs their bodies; it asks them
only for:

* their schemas (inputs, outputs, tags, whether a call with unused outputs is kept);
* their outputs' shapes, strides, dtypes and devices (the fake implementations);
* which inputs' gradients are present (not None) for a needs-input-grad pattern, which only
  the user's gradient function can say: AOTAutograd's trace of the backward asks it.

:class:`OpContract` holds the first two; :meth:`OpContract.define` registers the ops from
them, so that the caller's real ops and the compile worker's stand-ins (:func:`stand_ins`,
which answer the third question by asking the caller, ``_compile_process``) are defined by
the same code. A stand-in that would have to run a body raises, and the worker's compile then
fails (the caller compiles in its own process). Inductor's caches key a graph by its text,
which names the op and nothing of its behaviour: a program compiled against a stand-in that
differed from the real op would be loaded and served silently wrong. Hence one definition,
and the gradient question answered by the real op. See NOTE [compiles in a worker process].
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._compat import is_fake, kept_though_unused

__all__ = ["NAMESPACE", "OpContract", "Present", "TensorMeta", "contracts_in", "known", "present"]

NAMESPACE = "phi_torch_jit"


@dataclass(frozen=True)
class TensorMeta:
    """Shape, strides, dtype and device of a tensor (not the tensor: no data is kept)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device)

    def empty(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)


Present = Callable[[tuple[bool, ...], Sequence[TensorMeta], Sequence[TensorMeta]], tuple[bool, ...]]
"""``(pattern, saved, grad_outputs) -> present``: for a needs-input-grad ``pattern``, which
inputs' gradients are not None; ``saved`` describes the inputs then the outputs with
gradients, ``grad_outputs`` the gradients of those outputs."""


@dataclass(frozen=True)
class OpContract:
    """A custom function's op and its backward op as a compile sees them."""

    name: str
    """The forward op's name in :data:`NAMESPACE`; the backward op's is ``<name>_bwd``."""
    n_inputs: int
    n_grads: int
    """The leading outputs that get gradients (the function's own; the rest are values a
    library's checks read)."""
    outputs: tuple[TensorMeta, ...]
    tags: tuple[str, ...]
    """Names of the forward op's tags (``torch.Tag``)."""
    backward_tags: tuple[str, ...]
    """Names of the backward op's."""
    kept: bool
    """Whether a call is kept though its outputs are unused (it runs Python or checks)."""

    @property
    def backward_name(self) -> str:
        return f"{self.name}_bwd"

    def define(
        self,
        library: Any,
        impl: Callable[..., Any],
        backward: Callable[..., Any],
        setup_context: Callable[..., Any],
        backward_impl: Callable[..., Any],
    ) -> tuple[Any, Any]:
        """Define both ops in ``library`` (a ``torch.library.Library`` of :data:`NAMESPACE`)
        with these implementations and autograd formula; returns (op, backward op), their
        default overloads. The caller removes the library when it is done with the ops.

        The backward op, ``<name>_bwd(saved, grad_outputs, pattern)``, is what a graph
        capture's trace of the autograd formula records (:meth:`traced_backward`): the
        caller's backward compiles on real tensors, on demand, so the captured graph calls this
        op, which runs it when the graph runs. Gradients the backward leaves None come back as
        zeros (an op returns tensors only) and the formula drops them again. Defined with the
        forward op: code cached on disk may call it without tracing the formula again. See
        NOTE [opaque backward]."""
        inputs = ", ".join(f"Tensor x{i}" for i in range(self.n_inputs))
        total = len(self.outputs)
        returns = "Tensor" if total == 1 else f"({', '.join(['Tensor'] * total)})"
        tags = tuple(getattr(torch.Tag, tag) for tag in self.tags)
        # CONSERVATIVE: TorchScript's dead-code elimination keeps the call too
        aliasing = "CONSERVATIVE" if self.kept else ""
        library.define(f"{self.name}({inputs}) -> {returns}", alias_analysis=aliasing, tags=tags)
        library.impl(self.name, impl, "CompositeExplicitAutograd")
        qualified = f"{NAMESPACE}::{self.name}"
        torch.library.register_autograd(
            qualified, backward, setup_context=setup_context, lib=library
        )
        torch.library.register_fake(qualified, self.fake, lib=library)
        library.define(
            f"{self.backward_name}(Tensor[] saved, Tensor[] grad_outputs, bool[] pattern) "
            "-> Tensor[]",
            tags=tuple(getattr(torch.Tag, tag) for tag in self.backward_tags),
        )
        library.impl(self.backward_name, backward_impl, "CompositeExplicitAutograd")
        torch.library.register_fake(
            f"{NAMESPACE}::{self.backward_name}", self.backward_fake, lib=library
        )
        namespace = getattr(torch.ops, NAMESPACE)
        return getattr(namespace, self.name).default, getattr(namespace, self.backward_name).default

    def fake(self, *tensors: torch.Tensor) -> Any:
        """Outputs like the recorded ones, for graph capture (fake tensors)."""
        outputs = tuple(meta.empty() for meta in self.outputs)
        return outputs[0] if len(outputs) == 1 else outputs

    def backward_fake(
        self, saved: list[torch.Tensor], grad_outputs: list[torch.Tensor], pattern: list[bool]
    ) -> list[torch.Tensor]:
        return [torch.empty_like(x) for x in saved[: self.n_inputs]]

    def save(self, ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        """The autograd formula's ``setup_context``: the inputs and the outputs with gradients
        (not a library's values)."""
        outputs = output if isinstance(output, tuple) else (output,)
        ctx.save_for_backward(*inputs, *outputs[: self.n_grads])

    def traced_backward(
        self, backward_op: Any, ctx: Any, grad_outputs: tuple[Any, ...], present: Present
    ) -> tuple[Any, ...] | None:
        """The autograd formula while a graph capture traces the backward (fake tensors): a
        call of the backward op, its gradients None where ``present`` says so (an op returns
        tensors only). None when the tensors are real (the caller runs the backward)."""
        saved = ctx.saved_tensors
        grad_outputs = grad_outputs[: self.n_grads]
        if not any(is_fake(t) for t in (*saved, *grad_outputs) if isinstance(t, torch.Tensor)):
            return None
        pattern = tuple(bool(n) for n in ctx.needs_input_grad)
        grads = backward_op(list(saved), list(grad_outputs), list(pattern))
        metas = [TensorMeta.of(t) for t in saved], [TensorMeta.of(g) for g in grad_outputs]
        keep = present(pattern, *metas)
        return tuple(g if kept else None for g, kept in zip(grads, keep))


_KNOWN: dict[str, tuple[OpContract, Present]] = {}
_KNOWN_LOCK = threading.Lock()


def known(contract: OpContract, present: Present) -> Callable[[], None]:
    """Make ``contract`` (a real op of this process) known to :func:`contracts_in`, answering
    the gradient question with ``present``; returns the undo (when the op is removed)."""
    with _KNOWN_LOCK:
        _KNOWN[contract.name] = (contract, present)
        _KNOWN[contract.backward_name] = (contract, present)

    def undo() -> None:
        with _KNOWN_LOCK:
            for name in (contract.name, contract.backward_name):
                if _KNOWN.get(name, (None,))[0] is contract:
                    del _KNOWN[name]

    return undo


def contracts_in(graph: torch.fx.GraphModule) -> list[OpContract] | None:
    """The contracts of the custom-function ops ``graph`` calls (each once), or None when it
    calls another op that is not torch's own (a library's), one of ours no longer known, or
    a module or method (such a graph is not sent node for node)."""
    found: dict[str, OpContract] = {}
    for node in graph.graph.nodes:
        if node.op in ("call_module", "call_method"):
            return None
        if node.op != "call_function":
            continue
        namespace = getattr(node.target, "namespace", "aten")
        if namespace in ("aten", "prims"):
            continue
        if namespace != NAMESPACE:
            return None
        with _KNOWN_LOCK:
            entry = _KNOWN.get(node.target.name().partition("::")[2].partition(".")[0])
        if entry is None:
            return None
        found[entry[0].name] = entry[0]
    return list(found.values())


def present(
    name: str, pattern: tuple[bool, ...], saved: Sequence[TensorMeta], grads: Sequence[TensorMeta]
) -> tuple[bool, ...]:
    """The gradient question for the op ``name``, answered by the real op of this process;
    ``KeyError`` once that op is gone."""
    with _KNOWN_LOCK:
        _, answer = _KNOWN[name]
    return answer(pattern, saved, grads)


def stand_ins(contracts: Sequence[OpContract], ask: Callable[..., tuple[bool, ...]]) -> None:
    """In a compile worker: define the ops of ``contracts`` not defined yet, with bodies that
    refuse to run and a gradient question answered by ``ask(name, pattern, saved, grads)``.
    ``ValueError`` for a name defined already with another contract."""
    for contract in contracts:
        defined = _STAND_INS.get(contract.name)
        if defined is None:
            _STAND_INS[contract.name] = (contract, _stand_in(contract, ask))
        elif defined[0] != contract:
            raise ValueError(f"two contracts for the op {contract.name}")


def _stand_in(contract: OpContract, ask: Callable[..., tuple[bool, ...]]) -> Any:
    library = torch.library.Library(NAMESPACE, "FRAGMENT")
    ops: list[Any] = []

    def asked(*question: Any) -> tuple[bool, ...]:
        return ask(contract.name, *question)

    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        grads = contract.traced_backward(ops[1], ctx, grad_outputs, asked)
        return _refuse() if grads is None else grads

    ops.extend(contract.define(library, _refuse, backward, contract.save, _refuse))
    if contract.kept:
        kept_though_unused(ops[0])
    return library


_STAND_INS: dict[str, tuple[OpContract, Any]] = {}


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("a compile worker cannot run a custom function's body")
