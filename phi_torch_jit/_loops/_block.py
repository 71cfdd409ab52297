"""Loop capture, step 3: a captured loop runs as blocks of ``K`` predicated iterations.

A block is ``K`` calls of the iteration function (NOTE in :mod:`._rewrite`), then the next
iteration's first exit check, traced once per input signature (``make_fx``) and compiled by the
engine's backend (inductor: the iteration body fused into a few kernels). The host reads the
block's ``go`` flag once per block, not once per iteration; iterations after the exit change
nothing (``where(go, new, old)``), so values and iteration counts equal the Python loop's.
This is device-agnostic: on the CPU it saves the Python dispatch of each op (a CG iteration
is a dozen ops), on CUDA it saves ``K - 1`` host synchronizations of every ``K``.

A loop that has ended in its first block (a warm-started solve) runs a block of one iteration
first (NOTE [a short first block] in docs/loops.md).

Python ``int``/``float``/``bool`` values the loop carries (an iteration counter) are 0-d
tensors inside the block and Python values again after it. Anything the block cannot take
(another carried type, a non-scalar invariant that is not a tensor, a trace that fails: a
``float(x)`` in the body, a shape that changes) makes that signature run the same iteration
function eagerly, one iteration per host check (what the Python loop does), said once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from .._fast_capture import fast_metadata
from ..errors import NotNow
from ._compose import composed

__all__ = ["CapturedLoop", "HELPERS", "BLOCK_CPU", "BLOCK_CUDA", "CaptureFailed"]

logger = logging.getLogger("phi_torch_jit")

BLOCK_CPU = 4
"""Iterations per block on the CPU. Measured on a CG (a 5-point Laplacian) at N=32/128/512,
2 threads, inductor: per solve 1.31/6.2/60 ms with K=1, 0.82/4.7/61 with K=4, 0.72/4.6/66
with K=8, 1.29/4.8/67 with K=16 (eager 3.9/16.7/99, TorchScript's scripted loop
2.5/12.2/84); compile time grows with K (2.0, 2.8, 4.7, 8.5 s)."""
BLOCK_CUDA = 16
"""Iterations per block on CUDA (one host check per 16 iterations: ../shared/GPU.md)."""
MAX_BLOCKS = 8
"""Compiled blocks kept per loop (one per input signature); more run eagerly."""
SHORT_BACKOFF = 8
"""Runs of a signature that skip the one-iteration block after it failed to end the loop."""
_OWN_LOCK = threading.Lock()
"""Serializes block traces when the caller gives no lock (an engine gives the one all its FX
tracing takes: NOTE [one tracing thread] in docs/design.md)."""
BUSY = "another thread is tracing (this call runs the iterations eagerly; the next tries again)"
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device)


class CaptureFailed(Exception):
    """The block cannot be traced or compiled faithfully for these inputs."""


class Unfaithful(CaptureFailed):
    """Neither blocks nor the eager iteration function would equal the Python loop (a write
    in place the syntax does not show): the loop must not be captured at all."""


def _truth(value: Any, like: torch.Tensor | None = None) -> torch.Tensor:
    """``bool(value)`` as a 0-d bool tensor, on the device of ``like`` where given (a Python
    value's truth joins the loop's tensors: a CPU tensor would not combine with CUDA ones)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise CaptureFailed(f"a loop condition has {value.numel()} elements")
        value = value.reshape(())
        truth: torch.Tensor = value if value.dtype == torch.bool else value != 0
        if like is not None and truth.device != like.device:
            truth = truth.to(like.device)
        return truth
    return torch.tensor(bool(value), device=None if like is None else like.device)


def _first_tensor(values: Sequence[Any]) -> torch.Tensor | None:
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


def _stay(go: Any, leave: Any) -> torch.Tensor:
    like = _first_tensor((go, leave))
    return torch.logical_and(_truth(go, like), torch.logical_not(_truth(leave, like)))


def _and(*values: Any) -> torch.Tensor:
    like = _first_tensor(values)
    result = _truth(values[0], like)
    for value in values[1:]:
        result = torch.logical_and(result, _truth(value, like))
    return result


def _or(*values: Any) -> torch.Tensor:
    like = _first_tensor(values)
    result = _truth(values[0], like)
    for value in values[1:]:
        result = torch.logical_or(result, _truth(value, like))
    return result


def _not(value: Any) -> torch.Tensor:
    return torch.logical_not(_truth(value))


def _clone(values: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(v.clone() if isinstance(v, torch.Tensor) else v for v in values)


def _merge(
    go: Any,
    new: tuple[Any, ...],
    old: tuple[Any, ...],
    copies: tuple[Any, ...],
    in_place: tuple[bool, ...],
) -> tuple[Any, ...]:
    """A segment's results where ``go`` holds, the values before it elsewhere. ``copies``:
    what the segment started from; one written in place where the syntax shows no in-place
    write (``torch.add(a, b, out=x)``) would not be written back: refused."""
    merged = []
    for n, o, c, known in zip(new, old, copies, in_place):
        if n is c and isinstance(c, torch.Tensor) and c._version and not known:
            raise Unfaithful("its body writes a carried tensor in place by a call it cannot see")
        if isinstance(n, torch.Tensor) and isinstance(o, torch.Tensor):
            if n.shape != o.shape or n.dtype != o.dtype:
                raise CaptureFailed("a carried tensor changes its shape or dtype in the loop")
            if n.device != o.device:  # a flag made from Python values inside the body
                n = n.to(o.device)
            merged.append(torch.where(_truth(go, o), n, o))
        elif isinstance(n, torch.Tensor) or isinstance(o, torch.Tensor):
            raise CaptureFailed("a carried value changes between a tensor and a Python value")
        else:
            merged.append(n if bool(go) else o)
    return tuple(merged)


HELPERS = (_merge, _stay, _truth, _clone, _and, _or, _not)
"""In the order of ``_rewrite._HELPERS``."""

_KINDS = {bool: torch.bool, int: torch.int64, float: torch.float64}


class CapturedLoop:
    """The runtime of one captured loop: blocks per input signature, and the host loop."""

    def __init__(
        self,
        label: str,
        line: int,
        iterate: Callable[..., Any],
        enter: Callable[..., Any],
        in_place: tuple[bool, ...],
        mixed: tuple[bool, ...],
        compile_graph: Callable[[torch.fx.GraphModule, tuple[torch.Tensor, ...]], Any] | None,
        block: int | None = None,
        lock: Any = None,
        owner: str = "",
    ) -> None:
        self.label = label
        self.owner = owner
        """The function the loop is written in."""
        self.line = line
        """The loop's line in the user's file."""
        self.iterate = iterate
        self.enter = enter
        self.in_place = in_place
        """Per carried value: written in place, never rebound (``LoopPlan.in_place``)."""
        self.mixed = mixed
        """Per carried value: written in place and rebound (``LoopPlan.mixed``)."""
        self.compile_graph = compile_graph
        self.block = block
        self.lock = lock if lock is not None else _OWN_LOCK
        """Taken (never waited for) around a block's trace and compile."""
        self.programs: dict[Any, Callable[..., Any] | str] = {}
        """Per input signature: the compiled block, or why that signature runs eagerly."""
        self.eager_reasons: set[str] = set()
        """Why some inputs ran the iterations eagerly (for ``explain()``)."""
        self.blocks_run = 0
        """Blocks run (host checks), for tests and ``explain()``."""
        self.short: dict[Any, Callable[..., Any] | str] = {}
        """Per input signature: a block of one iteration, built once a run of the loop ended in
        its first block (a warm-started solve that converges in one iteration)."""
        self._short_skips: dict[Any, int] = {}
        """Per input signature where the one-iteration block runs first: how many runs skip it
        (after it did not end the loop)."""

    def __call__(self, carried: tuple[Any, ...], invariants: tuple[Any, ...]) -> tuple[Any, ...]:
        kinds = tuple(type(v) for v in carried)
        for value, mixed in zip(carried, self.mixed):
            if mixed and isinstance(value, torch.Tensor):
                raise CaptureFailed("it writes a carried tensor in place and also rebinds it")
        tensors = [v for v in (*carried, *invariants) if isinstance(v, torch.Tensor)]
        device = tensors[0].device if tensors else torch.device("cpu")
        state = tuple(
            torch.tensor(v, dtype=_KINDS[type(v)], device=device) if type(v) in _KINDS else v
            for v in carried
        )
        key = _signature(state, invariants)
        program = self._program(key, state, invariants, device)
        if isinstance(program, str):
            final = self._eagerly(state, invariants)
        else:
            final = self._in_blocks(key, program, state, invariants, device)
        return tuple(
            kind(v) if kind in _KINDS else _written_back(original, v, in_place)
            for kind, original, v, in_place in zip(kinds, carried, final, self.in_place)
        )

    def runs_straight_line(self) -> bool:
        """Whether a block still runs straight-line while a background compile replaces it
        (engine auto's ``BackgroundBlock``; for good where that compile failed)."""
        return any(getattr(p, "straight_line", False) for p in self.programs.values())

    def _eagerly(self, state: tuple[Any, ...], invariants: tuple[Any, ...]) -> tuple[Any, ...]:
        go = self.enter(*state, *invariants)
        while bool(go):
            go, *rest = self.iterate(go, *state, *invariants)
            state = tuple(rest)
        return state

    def _in_blocks(
        self,
        key: Any,
        program: Callable[..., Any],
        state: tuple[Any, ...],
        invariants: tuple[Any, ...],
        device: torch.device,
    ) -> tuple[Any, ...]:
        """The loop as blocks: first, where the loop has ended in its first block before, a
        block of one iteration (NOTE [a short first block] in docs/loops.md)."""
        inputs = _tensors_of(invariants)
        with torch.no_grad():  # a custom function's forward: its gradient is the user's
            go = _truth(self.enter(*state, *invariants), _first_tensor(state))
            flat = (go, *state)
            if not bool(go):
                return flat[1:]
            short = self._short_first(key, state, invariants, device)
            if short is not None:
                flat = tuple(short(*flat, *inputs))
                self.blocks_run += 1
                ended = not bool(flat[0])
                self._short_skips[key] = 0 if ended else SHORT_BACKOFF
                if ended:
                    return flat[1:]
            blocks = 0
            while bool(flat[0]):
                flat = tuple(program(*flat, *inputs))
                self.blocks_run += 1
                blocks += 1
            if short is None and blocks == 1 and key not in self._short_skips:
                self._short_skips[key] = 0  # ended in its first block: try one iteration first
        return flat[1:]

    def _short_first(
        self, key: Any, state: tuple[Any, ...], invariants: tuple[Any, ...], device: torch.device
    ) -> Callable[..., Any] | None:
        """The one-iteration block to run first for ``key``, or None: the loop has not ended
        in its first block, it skips the short block for a few runs, or the block is not
        compiled (yet: engine auto compiles it in the background; for good: it failed)."""
        skips = self._short_skips.get(key)
        if skips is None:
            return None
        if skips > 0:
            self._short_skips[key] = skips - 1
            return None
        short = self.short.get(key)
        if short is None:
            if not self.lock.acquire(blocking=False):
                return None
            try:
                short = self.short.get(key)
                if short is None:
                    try:
                        short = self._compile(state, invariants, device, size=1)
                    except NotNow:
                        return None
                    except Exception as error:  # the blocks of the full size serve alone
                        short = f"{type(error).__name__}: {error}".splitlines()[0]
                    self.short[key] = short
            finally:
                self.lock.release()
        if isinstance(short, str) or getattr(short, "straight_line", False):
            return None
        return short

    def _program(
        self, key: Any, state: tuple[Any, ...], invariants: tuple[Any, ...], device: torch.device
    ) -> Callable[..., Any] | str:
        if key is None:
            why = "it carries or reads a local value that is neither a tensor nor a Python scalar"
            if not self.eager_reasons:
                logger.info("phi_torch_jit: the loop of %s runs eagerly: %s", self.label, why)
            self.eager_reasons.add(why)
            return why
        program = self.programs.get(key)
        if program is not None:
            return program
        # make_fx and the backends keep process-wide state: one trace at a time. A compile
        # elsewhere (engine auto's thread, minutes) is not waited for.
        if not self.lock.acquire(blocking=False):
            return BUSY
        try:
            program = self.programs.get(key)
            if program is None:
                program = self._compile_or_why(key, state, invariants, device)
        finally:
            self.lock.release()
        return program

    def _compile_or_why(
        self, key: Any, state: tuple[Any, ...], invariants: tuple[Any, ...], device: torch.device
    ) -> Callable[..., Any] | str:
        if len(self.programs) >= MAX_BLOCKS:
            return f"more than {MAX_BLOCKS} input signatures"
        program: Callable[..., Any] | str
        try:
            program = self._compile(state, invariants, device)
        except Unfaithful:
            raise
        except NotNow:  # the engine cannot compile at this moment: eagerly, kept for no one
            return BUSY
        except Exception as error:  # a trace the block cannot take: this signature runs eagerly
            program = f"{type(error).__name__}: {error}".splitlines()[0]
            self.eager_reasons.add(program)
            logger.info(
                "phi_torch_jit: the loop of %s runs eagerly for these inputs: %s",
                self.label, program,
            )  # fmt: skip
        self.programs[key] = program
        return program

    def _compile(
        self,
        state: tuple[Any, ...],
        invariants: tuple[Any, ...],
        device: torch.device,
        size: int | None = None,
    ) -> Callable[..., Any]:
        size = size or self.block or (BLOCK_CUDA if device.type == "cuda" else BLOCK_CPU)
        slots = [_slot(v) for v in invariants]
        constants = [v if s is None else None for s, v in zip(slots, invariants)]
        iterate, enter, n = self.iterate, self.enter, len(state)

        def block(go: torch.Tensor, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
            for _ in range(size):
                go, *carried = one(go, *flat)
                flat = (*carried, *flat[n:])
            return last(go, *flat)

        def one(go: torch.Tensor, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
            tensors = iter(flat[n:])
            reads = [_read(s, c, tensors) for s, c in zip(slots, constants)]
            return tuple(iterate(go, *flat[:n], *reads))

        def last(go: torch.Tensor, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
            tensors = iter(flat[n:])
            reads = [_read(s, c, tensors) for s, c in zip(slots, constants)]
            carried = flat[:n]
            return (torch.logical_and(go, _truth(enter(*carried, *reads), go)), *carried)

        inputs = tuple(
            v.detach().clone()
            for v in (
                torch.ones((), dtype=torch.bool, device=device),
                *state,
                *_tensors_of(invariants),
            )
            if isinstance(v, torch.Tensor)
        )
        if any(not isinstance(v, torch.Tensor) for v in state):
            raise CaptureFailed("it carries a value that is neither a tensor nor a scalar")
        versions = [t._version for t in inputs]
        graph = composed(one, last, inputs, n, size)  # the iteration traced once, copied
        if graph is None:
            with torch.no_grad(), fast_metadata():
                graph = make_fx(block)(*inputs)
        if any(t._version != v for t, v in zip(inputs, versions)):
            raise Unfaithful("its body writes a value in place that it does not assign")
        if self.compile_graph is None:
            return graph  # type: ignore[no-any-return]
        return self.compile_graph(graph, inputs)  # type: ignore[no-any-return]


def _signature(state: Sequence[Any], invariants: Sequence[Any]) -> Any:
    key: list[Any] = []
    for n, value in enumerate((*state, *invariants)):
        if isinstance(value, torch.Tensor):
            key.append((value.shape, value.dtype, value.device))  # blocks run without grad
        elif isinstance(value, _SCALARS):
            key.append((type(value), value))
        elif n >= len(state) and _is_tensor_tuple(value):
            key.append(tuple((t.shape, t.dtype, t.device) for t in value))
        else:
            return None
    return tuple(key)


def _is_tensor_tuple(value: Any) -> bool:
    """A tuple of tensors, which an invariant may be (a sparse matrix's index and value
    tensors, PhiML's CG in ``adapters.phiml._cg``): the block takes its tensors as inputs."""
    return type(value) is tuple and all(isinstance(t, torch.Tensor) for t in value)


def _slot(value: Any) -> int | None:
    """How an invariant enters a block: -1 a tensor input, n >= 0 a tuple of n tensor inputs,
    None a constant."""
    if isinstance(value, torch.Tensor):
        return -1
    return len(value) if _is_tensor_tuple(value) else None


def _read(slot: int | None, constant: Any, tensors: Any) -> Any:
    if slot is None:
        return constant
    if slot < 0:
        return next(tensors)
    return tuple(next(tensors) for _ in range(slot))


def _tensors_of(invariants: Sequence[Any]) -> list[torch.Tensor]:
    """The tensors a block takes for ``invariants``, in order (tuples' items flattened)."""
    flat: list[torch.Tensor] = []
    for value in invariants:
        if isinstance(value, torch.Tensor):
            flat.append(value)
        elif _is_tensor_tuple(value):
            flat.extend(value)
    return flat


def _written_back(original: Any, final: Any, in_place: bool) -> Any:
    """The loop's final value; written into the carried tensor the loop started from when the
    loop writes that tensor in place (``x += d``): whoever holds it (the caller, a view) sees
    the write, as with the Python loop. Blocks work on copies: the original is untouched
    until here."""
    if in_place and isinstance(original, torch.Tensor) and original is not final:
        with torch.no_grad():
            original.copy_(final)
        return original
    return final
