"""PhiML / PhiFlow values as arguments and results of jitted functions.

PhiML tensors, fields, geometries and other PhiML tree nodes are split with
PhiML's own tree functions into native tensors and a static structure --
shapes, dimension names, extrapolations, bounds -- that becomes part of the
cache key (:class:`PhiKey`). Torch natives are traced; natives of other
backends (numpy arrays of a geometry built from Python numbers) are constants
in the key, compared by value. Used by :mod:`._signature` when it meets an
object of a ``phiml`` or ``phi`` module; PhiML is imported only then.

:class:`PhiMLBridge` makes PhiML's torch backend see our record and trace
passes as its own jit (see NOTE [PhiML bridge] in docs/design.md).
"""

from __future__ import annotations

import functools
import re
import sys
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from ._compat import get_tracing_state
from ._context import current_frame, note_module_call
from ._patches import RefCounted
from ._phiml_graph_capture import VIEW
from .errors import RunEagerly

__all__ = [
    "is_phiml",
    "PhiKey",
    "disassemble",
    "assemble",
    "PhiMLBridge",
    "traceable_forward",
    "ForwardChecks",
    "deferred_checks",
]

_MODULES = ("phiml.", "phi.")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def is_phiml(obj: Any) -> bool:
    """Whether ``obj`` is a PhiML/PhiFlow value (decided by its class's module, cheaply)."""
    return type(obj).__module__.startswith(_MODULES)


def _comparable(constant: Any) -> Any:
    """A hashable, comparable stand-in for a constant native (numpy array or number)."""
    if hasattr(constant, "tobytes"):
        return (type(constant).__name__, str(constant.dtype), constant.shape, constant.tobytes())
    return (type(constant).__name__, constant)


class PhiKey:
    """The static part of a PhiML value: hashable by its shapes, equal by its whole structure."""

    __slots__ = ("_hash", "constants", "converted", "metas", "shapes", "slots", "specs", "tree")

    def __init__(
        self,
        tree: Any,
        shapes: tuple[Any, ...],
        specs: tuple[Any, ...],
        natives: Sequence[Any],
        converted: bool = False,
    ) -> None:
        self.tree = tree
        self.converted = converted
        """Whether float natives of other backends became torch tensors (:func:`_as_traced`):
        the record pass must then run on the converted values, as the trace does."""
        self.shapes = shapes
        self.specs = tuple(_frozen(s) for s in specs)
        """PhiML's per-tensor specs, lists made tuples (PhiML hands back dimension names as a
        list where the input had a tuple: the same layout must not retrace)."""
        self.slots = tuple(None if isinstance(n, torch.Tensor) else n for n in natives)
        """Per native: None for a traced torch tensor, else the constant itself."""
        self.constants = tuple(_comparable(n) for n in self.slots if n is not None)
        self.metas = tuple(
            (tuple(n.shape), n.dtype, n.device, n.requires_grad)
            for n in natives
            if isinstance(n, torch.Tensor)
        )
        """Shape, dtype, device and requires_grad of each traced native, as for plain tensors."""
        self._hash = hash((shapes, self.metas))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PhiKey):
            return NotImplemented
        if self.metas != other.metas or self.shapes != other.shapes:
            return False
        if self.constants != other.constants:
            return False
        if self.specs is other.specs and self.tree is other.tree:
            return True
        try:
            equal = bool(self.specs == other.specs) and bool(self.tree == other.tree)
        except Exception:  # structures that cannot be compared are not equal
            return False
        if equal:  # share one structure: NOTE [PhiML bridge], equal keys adopt one structure
            self.specs, self.tree = other.specs, other.tree
        return equal

    def difference(self, other: PhiKey) -> str:
        """What differs from ``other``, e.g. ``native 0 dtype int64 -> float32``."""
        fields = ("shape", "dtype", "device", "requires_grad")
        for i, (old, new) in enumerate(zip(self.metas, other.metas)):
            changes = [f"{f} {x} -> {y}" for f, x, y in zip(fields, old, new) if x != y]
            if changes:
                return f"PhiML native {i} " + ", ".join(changes)
        for name, old, new in (
            ("shape", self.shapes, other.shapes),
            ("layout", self.specs, other.specs),
            ("constants", self.constants, other.constants),
        ):
            if old != new:
                return f"PhiML {name}: {_short(old)} -> {_short(new)}"
        return f"PhiML structure: {_short(self.tree)} -> {_short(other.tree)}"

    def __repr__(self) -> str:
        shapes = ", ".join(_ANSI.sub("", str(shape)) for shape in self.shapes)
        return f"PhiML[{shapes}]"


def _frozen(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in value.items()}
    return value


def _short(value: Any) -> str:
    text = _ANSI.sub("", str(value))
    return text if len(text) <= 80 else text[:77] + "..."


def disassemble(obj: Any, tensors: list[torch.Tensor]) -> PhiKey:
    """Append the torch tensors of ``obj`` to ``tensors``; return its static structure.

    A value this module assembled (a program's output, passed to the next step) is not taken
    apart again: its key and tensors are known (:func:`_remembered`)."""
    known = _remembered(obj)
    if known is not None:
        key, natives = known
        tensors.extend(natives)
        return key
    from phiml.math._tensors import disassemble_tensors
    from phiml.math._tree import disassemble_tree

    tree, values = disassemble_tree(obj, cache=False, attr_type=_traced_attributes)
    # expand: natives in PhiML's canonical layout (as PhiML's own jit keys them), so a state made
    # by eager code and one made by the program share a key (no retrace for a transposed or a
    # still-uniform field)
    natives, shapes, specs = disassemble_tensors(values, expand=True)
    traced = [_as_traced(n) for n in natives]
    converted = any(t is not n for t, n in zip(traced, natives))
    tensors.extend(n for n in traced if isinstance(n, torch.Tensor))
    return PhiKey(tree, tuple(shapes), tuple(specs), traced, converted)


def _traced_attributes(obj: Any) -> tuple[str, ...]:
    """The attributes of a PhiML value whose tensors are traced inputs: PhiML's variable
    attributes and, for a dataclass (a ``Field``), any other attribute holding torch tensors.

    Torch tensors are data a program computed: a point cloud advected by a step comes back as
    a ``Field`` whose geometry (the points' locations) is not a variable attribute, and as a
    constant of the key it differed on every call (a retrace per step, PhiML's own jit too).
    Constants built from Python or numpy values (a grid's bounds) stay in the key."""
    from phiml.math._tree import variable_attributes

    names: tuple[str, ...] = variable_attributes(obj)
    if not isinstance(obj, type) and hasattr(obj, "__dataclass_fields__"):
        extra = tuple(
            name for name in _all_attributes(obj)
            if name not in names and _holds_torch(getattr(obj, name, None))
        )  # fmt: skip
        if extra:
            return (*names, *extra)
    return names


_ALL_ATTRIBUTES: dict[type, tuple[str, ...]] = {}
_BY_INSTANCE = ("__all_attrs__", "__variable_attrs__", "__value_attrs__")


def _all_attributes(obj: Any) -> tuple[str, ...]:
    """PhiML's ``all_attributes``, kept per class where the class decides them (its data
    fields) rather than each instance."""
    from phiml.math._tree import all_attributes

    cls = type(obj)
    names = _ALL_ATTRIBUTES.get(cls)
    if names is None:
        names = tuple(all_attributes(obj))
        if not any(hasattr(cls, method) for method in _BY_INSTANCE):
            _ALL_ATTRIBUTES[cls] = names
    return names


class _ByIdentity:
    """Values kept for objects while those objects live (weak references, by identity):
    PhiML values are immutable. Objects that cannot be weakly referenced are not kept."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[Any], Any]] = {}

    def get(self, obj: Any) -> Any:
        """What :meth:`put` kept for ``obj`` (None: nothing)."""
        entry = self._entries.get(id(obj))
        return entry[1] if entry is not None and entry[0]() is obj else None

    def put(self, obj: Any, value: Any) -> None:
        ident = id(obj)
        try:
            ref = weakref.ref(obj, lambda dead: self._forget(ident, dead))
        except TypeError:
            return
        self._entries[ident] = (ref, value)

    def _forget(self, ident: int, dead: weakref.ref[Any]) -> None:
        entry = self._entries.get(ident)
        if entry is not None and entry[0] is dead:
            del self._entries[ident]


_HELD = _ByIdentity()
"""Answers of :func:`_holds_torch`: a grid's geometry is the same object from step to step
(the walk costs ~0.1 ms a field)."""


def _holds_torch(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return False
    held: bool | None = _HELD.get(value)
    if held is None:
        held = _walk_holds_torch(value)
        _HELD.put(value, held)
    return held


def _walk_holds_torch(value: Any) -> bool:
    from phiml.math import Tensor
    from phiml.math._tree import all_attributes, disassemble_tree

    try:
        _, tensors = disassemble_tree(value, cache=False, attr_type=all_attributes)
    except Exception:  # not a PhiML tree: nothing PhiML would trace
        return False
    return any(
        isinstance(native, torch.Tensor)
        for tensor in tensors if isinstance(tensor, Tensor)
        for native in tensor._natives()
    )  # fmt: skip


def _as_traced(native: Any) -> Any:
    """Floating-point numpy and Python natives as torch tensors (traced inputs, as PhiML's own
    jit converts them): a rotating obstacle's rotation or a moved geometry's center must not be
    a constant of the key, or every new value would retrace. Integer and boolean natives
    (counts, indices, masks) stay constants, compared by value."""
    floating = isinstance(native, float) or (
        hasattr(native, "dtype") and not isinstance(native, torch.Tensor)
        and getattr(native.dtype, "kind", "") in "fc"
    )  # fmt: skip
    if not floating:
        return native
    from phiml.backend.torch import TORCH

    return TORCH.as_tensor(native)


def assemble(key: PhiKey, tensors: Iterator[torch.Tensor]) -> Any:
    """Inverse of :func:`disassemble`: rebuild the value from new torch tensors.

    Dataclasses whose ``__post_init__`` only checks shapes (PhiFlow's ``Field``) are built
    without running the check: the structure and shapes are the ones checked when the program
    was traced, and the check costs more than the compiled step (NOTE [PhiML bridge]).
    """
    from phiml.math._tensors import assemble_tensors

    natives = [next(tensors) if slot is None else slot for slot in key.slots]
    values = assemble_tensors(natives, key.specs)
    obj = _assemble(key.tree, values)
    _ASSEMBLED.put(obj, (key, tuple(n for n, slot in zip(natives, key.slots) if slot is None)))
    return obj


_ASSEMBLED = _ByIdentity()
"""Values :func:`assemble` built, with their key and torch tensors, while they live. Taking a
staggered grid apart costs about 1 ms (PhiML stacks its components' shapes), more than many
compiled steps; a rollout passes each step's outputs to the next step."""


def _remembered(obj: Any) -> tuple[PhiKey, tuple[torch.Tensor, ...]] | None:
    """The key and tensors of a value :func:`assemble` built, if its tensors still have the
    shape, dtype, device and requires_grad the key says (``requires_grad_()`` may change)."""
    entry = _ASSEMBLED.get(obj)
    if entry is None:
        return None
    key, natives = entry
    metas = tuple((tuple(n.shape), n.dtype, n.device, n.requires_grad) for n in natives)
    return (key, natives) if metas == key.metas else None


def _assemble(node: Any, values: list[Any]) -> Any:
    from phiml.math._tree import DataclassTreeNode, assemble_tree

    if isinstance(node, tuple):
        return tuple(_assemble(item, values) for item in node)
    if isinstance(node, list):
        return [_assemble(item, values) for item in node]
    if type(node) is dict and "__layout__" not in node:
        return {name: _assemble(item, values) for name, item in node.items()}
    if isinstance(node, DataclassTreeNode) and _checks_only(node.cls):
        instance = node.cls.__new__(node.cls)
        for name, item in node.extracted.items():
            object.__setattr__(instance, name, _assemble(item, values))
        for name, value in node.not_extracted.items():
            object.__setattr__(instance, name, value)
        instance.__dict__.update(node.cache or {})
        return instance
    return assemble_tree(node, values)  # takes its tensors from the front of ``values``


_CHECK_ONLY = {"phi.field._field.Field": frozenset(
    {"math", "merge_shapes", "values", "non_batch", "sampled_elements", "non_channel"}
)}  # fmt: skip
"""Classes whose ``__post_init__`` is a shape check, with the names that check may read: if a
PhiFlow version reads anything else there, its ``__post_init__`` runs as usual."""


def _checks_only(cls: type) -> bool:
    return _post_init_checks_only(cls, getattr(cls, "__post_init__", None))


@functools.lru_cache(maxsize=64)
def _post_init_checks_only(cls: type, post_init: Any) -> bool:
    """Read once per class and ``__post_init__`` (a replaced one is read again)."""
    known = _CHECK_ONLY.get(f"{cls.__module__}.{cls.__qualname__}")
    code = getattr(post_init, "__code__", None)
    return (
        known is not None
        and code is not None
        and not code.co_freevars
        and set(code.co_names) <= known
    )


_CUSTOM_FUNCTION = ("phiml.backend.torch._torch_backend", "construct_torch_custom_function.")


def _is_custom_function(cls: type) -> bool:
    return cls.__module__ == _CUSTOM_FUNCTION[0] and cls.__qualname__.startswith(
        _CUSTOM_FUNCTION[1]
    )


def backward_scope(cls: type) -> AbstractContextManager[Any]:
    """What a PhiML custom-gradient Function's backward runs in when we run it: its adjoint
    solve builds a sparse matrix with PhiML's ``sparse_coo_tensor``, which scripts itself with
    TorchScript on every call; built directly here (``_SparseCoo``), as in its forward. Other
    classes: nothing."""
    return _SPARSE_COO.active() if _is_custom_function(cls) else nullcontext()


def traceable_forward(cls: type) -> Callable[..., Any] | None:
    """The forward to run for a PhiML custom-gradient Function class, or None for other classes.

    PhiML's Function answers any TorchScript trace with the output its own jit recorded
    (its trace pass must not run the solve twice). Our forward compile traces the forward on
    purpose, so it calls the function PhiML wraps directly -- PhiML's backend then takes its
    traced paths, e.g. the scripted CG loop -- and fills ctx as PhiML's forward does (inputs and
    outputs saved, ``input_count`` set), which PhiML's backward reads.
    """
    if not _is_custom_function(cls):
        return None
    function: Any = cls.__dict__.get("forward")
    function = getattr(function, "__func__", function)
    code = getattr(function, "__code__", None)
    if code is None or not {"f", "jit_f"} <= set(code.co_freevars):
        return None  # a PhiML version we do not know: its own forward runs
    cells = dict(zip(code.co_freevars, function.__closure__))
    wrapped = cells["jit_f"].cell_contents or cells["f"].cell_contents

    def forward(ctx: Any, *args: Any) -> Any:
        with _SPARSE_COO.active():
            outputs = wrapped(*args)
        ctx.save_for_backward(*args, *outputs)
        ctx.input_count = len(args)
        return outputs

    forward.__module__ = cls.__module__  # PhiML's code: its CG loops may be captured
    return forward


class ForwardChecks:
    """PhiML convergence checks met while a custom forward was traced (values unavailable).

    The tensors they need become extra outputs of the compiled forward; :meth:`run` calls the
    checks with the values of each compiled call, so ``NotConverged`` and ``Diverged`` are
    raised on the same calls as in eager code. ``always``: checks are deferred even where
    values are available (a forward run as Python around a captured loop returns them as the
    traced forward does)."""

    def __init__(self, always: bool = False) -> None:
        self.always = always
        self.checks: list[Deferred] = []
        self.tensors: list[torch.Tensor] = []

    def add(self, check: Deferred, tensors: list[torch.Tensor]) -> None:
        self.checks.append(check)
        self.tensors.extend(tensors)

    def run(self, tensors: Sequence[torch.Tensor]) -> None:
        start = 0
        for check in self.checks:
            check.call(tensors[start : start + check.count])
            start += check.count


_COLLECTING: ContextVar[ForwardChecks | None] = ContextVar("phi_torch_jit_checks", default=None)


@contextmanager
def deferred_checks(always: bool = False) -> Iterator[ForwardChecks]:
    """Collect PhiML's convergence checks skipped under a trace while the block runs (all of
    them, values available or not, if ``always``)."""
    checks = ForwardChecks(always)
    if "phiml.math._optimize" not in sys.modules:
        yield checks
        return
    token = _COLLECTING.set(checks)
    try:
        with _CHECKS.active(), _LOOPS.active():
            yield checks
    finally:
        _COLLECTING.reset(token)


class _ConvergenceCheck:
    """``SolveInfo.convergence_check`` that defers itself to a collector while values are
    unavailable (a forward being traced), instead of silently skipping."""

    def __init__(self) -> None:
        self.original: Any = None

    def install(self) -> None:
        from phiml.math._optimize import SolveInfo

        original = self.original = SolveInfo.__dict__["convergence_check"]

        def convergence_check(info: Any, only_warn: bool) -> None:
            from phiml.math import all_available

            collector = _COLLECTING.get()
            if collector is None:
                token = _CHECKING.set(True)  # the record pass under install(): values are real
                try:
                    formatted = _with_message(info)
                    for tape in open_tapes():  # the solve just added its raw info to them
                        tape.solves[:] = [formatted if s is info else s for s in tape.solves]
                    return original(formatted, only_warn)  # type: ignore[no-any-return]
                finally:
                    _CHECKING.reset(token)
            if not collector.always and all_available(info.diverged, info.converged):
                return original(info, only_warn)  # type: ignore[no-any-return]
            parts = (info.x, info.residual, info.iterations, info.function_evaluations,
                     info.converged, info.diverged)  # fmt: skip
            natives: list[torch.Tensor] = []
            key = disassemble(parts, natives)

            def check(*values: Any) -> None:
                token = _CHECKING.set(True)
                try:  # built with real values: PhiML writes eager's message
                    real = SolveInfo(info.solve, *values, info.method, info.msg, info.solve_time)
                    original(real, only_warn)
                finally:
                    _CHECKING.reset(token)

            converged = _positions(info.converged, natives)
            diverged = _positions(info.diverged, natives)
            known = None if converged is None or diverged is None else (converged, diverged)
            collector.add(Deferred(key, check, len(natives), info, known), natives)
            return None

        SolveInfo.convergence_check = convergence_check

    def remove(self) -> None:
        from phiml.math._optimize import SolveInfo

        SolveInfo.convergence_check = self.original


def _positions(flag: Any, natives: Sequence[torch.Tensor]) -> tuple[int, ...] | None:
    """Where the torch natives of the PhiML tensor ``flag`` are among ``natives`` (None: it
    has other natives, or none)."""
    own: list[torch.Tensor] = []
    disassemble(flag, own)
    positions = tuple(
        next((i for i, n in enumerate(natives) if n is native), -1) for native in own
    )  # fmt: skip
    return positions if own and -1 not in positions else None


def _with_message(info: Any) -> Any:
    """``info`` built anew while its values count as available: PhiML formats the message
    (``did not converge to rel_tol=... Max residual: ...``) only then; the solve ran while
    PhiML saw our pass as its jit, so its own ``SolveInfo`` kept the raw message."""
    from phiml.math._optimize import SolveInfo

    return SolveInfo(info.solve, info.x, info.residual, info.iterations,
                     info.function_evaluations, info.converged, info.diverged, info.method,
                     info.msg, info.solve_time)  # fmt: skip


class _WhileLoop:
    """``TorchBackend.while_loop`` that never lets a trace repeat a fixed iteration count.

    PhiML's torch backend unrolls ``while_loop`` to ``max_iter`` iterations under a TorchScript
    trace (with a RuntimeWarning): a loop whose count depends on values would then be wrong
    for other values. In a record pass, a loop outside any custom function is noted (the
    specialization runs eagerly, with one warning); under a trace it raises ``RunEagerly``, so a
    custom forward being compiled runs as Python instead (NOTE [PhiML bridge])."""

    def __init__(self) -> None:
        self.original: Any = None

    def install(self) -> None:
        from phiml.backend.torch._torch_backend import TorchBackend

        original = self.original = TorchBackend.__dict__["while_loop"]

        def while_loop(self_: Any, loop: Any, values: Any, max_iter: Any) -> Any:
            if get_tracing_state() is not None:
                raise RunEagerly(
                    f"it runs a PhiML while_loop, which a trace would unroll to {max_iter} "
                    "iterations"
                )
            from ._unguardable import note_unguardable

            note_unguardable("loops", "PhiML while_loop")
            return original(self_, loop, values, max_iter)

        TorchBackend.while_loop = while_loop

    def remove(self) -> None:
        from phiml.backend.torch._torch_backend import TorchBackend

        TorchBackend.while_loop = self.original


_LOOP_PATCH = _WhileLoop()
_LOOPS = RefCounted(_LOOP_PATCH.install, _LOOP_PATCH.remove)


class _SparseCoo:
    """``TorchBackend.sparse_coo_tensor`` without ``torch.jit.script`` unless TorchScript traces.

    PhiML scripts a helper on every call so that a TorchScript trace does not bake the sparse
    matrix as a constant. Our passes and PhiML forwards (record, graph capture, bodies run as
    Python) need no TorchScript (engine "auto" runs none): the matrix is built directly, as the
    helper builds it; under a TorchScript trace (engine "torchscript") PhiML's own runs."""

    def __init__(self) -> None:
        self.original: Any = None

    def install(self) -> None:
        from phiml.backend.torch._torch_backend import TorchBackend, to_torch_dtype

        original = self.original = TorchBackend.__dict__["sparse_coo_tensor"]

        def sparse_coo_tensor(self_: Any, indices: Any, values: Any, shape: Any) -> Any:
            if get_tracing_state() is not None:
                return original(self_, indices, values, shape)
            indices = self_.transpose(self_.to_int64(indices), [1, 0])
            (values,) = self_.auto_cast(values)
            size = torch.Size([int(shape[0]), int(shape[1])])
            dtype = to_torch_dtype(self_.float_type)
            return torch.sparse_coo_tensor(indices, values, size=size, dtype=dtype)

        TorchBackend.sparse_coo_tensor = sparse_coo_tensor

    def remove(self) -> None:
        from phiml.backend.torch._torch_backend import TorchBackend

        TorchBackend.sparse_coo_tensor = self.original


_SPARSE_COO_PATCH = _SparseCoo()
_SPARSE_COO = RefCounted(_SPARSE_COO_PATCH.install, _SPARSE_COO_PATCH.remove)


_CHECK_PATCH = _ConvergenceCheck()
_CHECKS = RefCounted(_CHECK_PATCH.install, _CHECK_PATCH.remove)


class PhiMLBridge:
    """Lets PhiML's torch backend treat a phi_torch_jit specialization as its own jit.

    PhiML's custom gradients (e.g. the implicit pressure solve) keep per-signature output
    mappings and, under tracing, expect the jit that traces them to hand back the mapping
    recorded on the untraced pass. PhiML asks the last entry of its ``CURRENT_JIT_CALLS``
    list; while our record and trace passes run, that entry is this object. See NOTE
    [PhiML bridge] in docs/design.md.
    """

    is_phi_torch_jit_bridge = True
    """How :mod:`._phiml_graph_capture` knows the jit on PhiML's stack is ours."""

    def __init__(self) -> None:
        self.recording = False
        """Whether the pass on PhiML's stack now is the record pass (values are real)."""
        self.called_modules: set[Any] = set()
        """Modules PhiML's networks registered (forwarded to register_module_call)."""
        self._calls: list[Any] = []
        self._after_record: list[tuple[Any, tuple[Any, ...]]] = []
        self._replayed = 0
        self._calls_seen = 0
        self.outer_tapes: tuple[Any, ...] = ()
        """PhiML ``SolveTape``s open when the pass began: the record pass and compiled calls
        fill them; the trace pass fills only the tapes the function opens itself."""

    @property
    def used(self) -> bool:
        """Whether PhiML made custom-gradient calls in the record pass."""
        return bool(self._calls)

    def record_autograd_function_call(
        self, function: Any, args: Any, output: Any, ext_cache: Any, jit_compile: bool = True
    ) -> None:
        """PhiML, untraced pass: a custom-gradient call happened (our adapter recorded it)."""
        self._calls.append(ext_cache)

    def extract_and_call(self, tensors: tuple[Any, ...], runnable: Any) -> None:
        """PhiML, traced pass: ``math.when_available(runnable, *tensors)`` waits for values.

        The tensors' torch natives become extra outputs of the program, and every compiled
        call rebuilds the PhiML tensors from them and calls ``runnable`` (as PhiML's jit does
        after its calls). In the record pass the values are available and PhiML calls
        ``runnable`` at once."""
        if _phiml_jit_tracing():  # under install(): PhiML's own jit extracts and calls it
            return
        if self.recording:  # real values: called when the record pass has returned
            self._after_record.append((runnable, tensors))
            return
        frame = current_frame()
        if frame is None:
            raise RuntimeError("phi_torch_jit: PhiML deferred a call outside a trace")
        natives: list[torch.Tensor] = []
        key = disassemble(tuple(tensors), natives)
        frame.outputs.deferred.append(Deferred(key, runnable, len(natives)))
        frame.outputs.deferred_tensors.extend(natives)

    @property
    def _tracing_in_key(self) -> Any:
        """What PhiML's ``perf_counter`` asks a tracing jit for: its backend."""
        from phiml.backend.torch import TORCH

        return types.SimpleNamespace(backend=TORCH)

    def get_compiled_function(self, function: Any, args: Any) -> tuple[Any, Any]:
        """PhiML, traced pass: return (what to apply, the recorded external cache)."""
        if self._replayed >= len(self._calls):
            raise RuntimeError("phi_torch_jit: PhiML made more custom-gradient calls while tracing")
        ext_cache = self._calls[self._replayed]
        self._replayed += 1
        return function, ext_cache  # its apply() reaches our replay through the interception

    @contextmanager
    def active(self, recording: bool = False) -> Iterator[None]:
        """Make PhiML see this bridge as the current jit while the block runs (if PhiML is used).

        ``recording``: the record pass. PhiML treats every value as unavailable while a jit is
        on its stack, in both passes, as under its own jit: the record pass then takes the same
        paths as the trace (e.g. a solve matrix built from traced geometry values is a torch
        tensor in both). Two things still see the record pass's real values: convergence
        checks (``NotConverged`` on the same calls as eager code) and ``math.when_available``
        callbacks, called with the real values when the record pass has returned.
        """
        backend = sys.modules.get("phiml.backend.torch._torch_backend")
        if backend is None:
            yield
            return
        self._replayed = 0
        self.recording = recording
        self.outer_tapes = open_tapes()
        self._after_record = []
        stack = backend.CURRENT_JIT_CALLS
        stack.append(self)
        tracing = sys.modules["phiml.math._functional"]._TRACING_JIT
        tracing.append(self)  # when_available asks PhiML's own jit stack
        try:
            with _AVAILABILITY.active(), _CHECKS.active(), _LOOPS.active(), VIEW.active():
                with _SPARSE_COO.active():
                    yield
        finally:
            stack.remove(self)
            tracing.remove(self)
            self._forward_modules()
        for runnable, tensors in self._after_record:  # the record pass returned
            runnable(*tensors)

    def tapes_hidden(self) -> AbstractContextManager[None]:
        """While the block runs, PhiML's open ``SolveTape``s are set aside: for a run of the
        program that is not a call of the user's (a backend's warm-up on the trace inputs)."""
        return tapes_set_aside() if self.used else nullcontext()

    def _forward_modules(self) -> None:
        for module in self.called_modules:
            note_module_call(module)


class _Availability:
    """``TorchBackend.is_available`` that says True for the convergence checks of our record
    passes (see :meth:`PhiMLBridge.active`); installed while any bridge is active."""

    def __init__(self) -> None:
        self._original: Any = None

    def install(self) -> None:
        from phiml.backend.torch import _torch_backend as backend

        original = self._original = backend.TorchBackend.__dict__["is_available"]

        def is_available(self_: Any, tensor: Any) -> bool:
            stack = backend.CURRENT_JIT_CALLS
            recording = stack and isinstance(stack[-1], PhiMLBridge) and stack[-1].recording
            if recording and _CHECKING.get():  # a record pass's convergence check: real values
                return get_tracing_state() is None
            return bool(original(self_, tensor))

        backend.TorchBackend.is_available = is_available

    def remove(self) -> None:
        from phiml.backend.torch import _torch_backend as backend

        backend.TorchBackend.is_available = self._original


def _phiml_jit_tracing() -> bool:
    """Whether PhiML's own ``jit_compile`` is tracing (phi_torch_jit runs under ``install()``)."""
    functional = sys.modules.get("phiml.math._functional")
    return functional is not None and any(
        not isinstance(j, PhiMLBridge) for j in functional._TRACING_JIT
    )


_CHECKING: ContextVar[bool] = ContextVar("phi_torch_jit_checking", default=False)


_AVAILABILITY_PATCH = _Availability()
_AVAILABILITY = RefCounted(_AVAILABILITY_PATCH.install, _AVAILABILITY_PATCH.remove)


@dataclass(frozen=True)
class Deferred:
    """A ``math.when_available`` callback met while tracing, with how to rebuild its args."""

    key: PhiKey
    """Structure of the PhiML tensors it receives."""
    runnable: Any
    """The callback."""
    count: int
    """How many torch natives the program returns for it."""
    solve_info: Any = None
    """For a convergence check: the ``SolveInfo`` it was met with (solve, method, message),
    from which :func:`solve_infos` rebuilds one around the program's tensors."""
    flags: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    """For a convergence check: which natives are its ``converged`` and its ``diverged``
    flags (None: unknown). All converged and none diverged, the check passes without the
    ``SolveInfo`` built (about 0.5 ms a call: PhiML formats its message)."""

    def call(self, natives: Sequence[torch.Tensor]) -> None:
        if self.flags is not None:
            converged, diverged = self.flags
            if all(bool(natives[i].all()) for i in converged) and not any(
                bool(natives[i].any()) for i in diverged
            ):
                return
        self.runnable(*assemble(self.key, iter(natives)))


def solve_infos(checks: Sequence[Deferred], natives: Sequence[Any], real: bool) -> list[Any]:
    """The ``SolveInfo`` of each convergence check among ``checks``, rebuilt around the
    tensors the program returned for it (``real``: values, so PhiML formats its message).
    NOTE [SolveTape under jit]."""
    from phiml.math._optimize import SolveInfo

    infos, start = [], 0
    for check in checks:
        values = natives[start : start + check.count]
        start += check.count
        template = check.solve_info
        if template is None:
            continue
        token = _CHECKING.set(real)
        try:
            parts = assemble(check.key, iter(values))
            infos.append(SolveInfo(template.solve, *parts, template.method, template.msg,
                                   template.solve_time))  # fmt: skip
        finally:
            _CHECKING.reset(token)
    return infos


def open_tapes() -> tuple[Any, ...]:
    """PhiML's ``SolveTape``s open now (none if PhiML's optimizer is not imported)."""
    optimize = sys.modules.get("phiml.math._optimize")
    return tuple(optimize._SOLVE_TAPES) if optimize is not None else ()


@contextmanager
def tapes_set_aside() -> Iterator[None]:
    """While a solve's forward is traced (compiled), its SolveInfo holds tracer values: the
    open tapes are set aside, and a throwaway tape stands in for them, so the solve computes
    what it computes for a tape (its residual)."""
    optimize = sys.modules.get("phiml.math._optimize")
    if optimize is None or not optimize._SOLVE_TAPES:
        yield
        return
    tapes = optimize._SOLVE_TAPES
    saved = list(tapes)
    tapes[:] = [optimize.SolveTape()]
    try:
        yield
    finally:
        tapes[:] = saved


def add_to_tapes(infos: Sequence[Any], skip: tuple[Any, ...] = ()) -> None:
    """Add ``infos`` to the open ``SolveTape``s, except those in ``skip``, as PhiML's solve
    does after it ran (trajectories are not recorded: NOTE [SolveTape under jit])."""
    for tape in open_tapes():
        if all(tape is not s for s in skip):
            for info in infos:
                tape._add(info.solve, False, info)
