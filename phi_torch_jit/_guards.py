"""Stage 5: guard the module state a compiled program silently depends on.

The argument spec does not see the modules a function calls, yet a trace
bakes in their state: each module's training flag (Dropout and BatchNorm
trace differently), the hooks that ran (forward hooks are traced in, and
hooks added later would be ignored), and which tensor objects are its
parameters and buffers (the traced program holds those objects; assigning a
new ``nn.Parameter`` or ``load_state_dict(assign=True)`` replaces them).

A :class:`ModuleGuard` snapshots that state after the record pass and is
checked before every compiled call; a mismatch retraces (and the old
specialization stays cached, so switching ``train()``/``eval()`` back and
forth reuses both). ``jit(..., guard_hooks=False)`` checks training flags
only, like torch.compile's ``skip_nnmodule_hook_guards``. In-place updates
(``optimizer.step()``, ``load_state_dict`` without ``assign``) keep the
objects and need no retrace. See NOTE [module guards] in docs/design.md.
"""

from __future__ import annotations

import functools
import operator
import types
from collections.abc import Iterable, Mapping, Sequence
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ._attribute_values import GONE, changed, strictly_same
from ._compat import MODULE_HOOK_DICTS, global_module_hooks
from ._phases import MODULE_HOOK
from ._reads._code_walk import user_class
from ._reads._records import PYTHONS_OWN, immutable
from ._scripted_modules import ScriptedState, scripted

__all__ = ["ModuleGuard", "has_backward_hooks"]

_GLOBAL_HOOK_DICTS = global_module_hooks()  # forward pre, forward, backward pre, backward
_training = operator.attrgetter("training")
_TENSOR_META = operator.attrgetter("dtype", "device", "shape", "requires_grad")


def has_backward_hooks(modules: Iterable[nn.Module]) -> bool:
    """Whether backward hooks (per module or global) would fire for these modules."""
    if _GLOBAL_HOOK_DICTS[2] or _GLOBAL_HOOK_DICTS[3]:
        return True
    return any(m._backward_hooks or m._backward_pre_hooks for m in modules)


_CHILDREN = operator.attrgetter("_modules")

_CODE = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)
"""Code held as a module's attribute (``self.act = torch.tanh``, ``net.forward = f``): which
one, by identity."""

_REGISTRIES = tuple(name for name, value in vars(nn.Module()).items() if isinstance(value, dict))
"""A module's dicts of tensors, submodules and hooks, by identity (NOTE [module guards]): one
replaced (``__setstate__``, ``m._forward_hooks = {}``) may hold equal entries, or none."""
_TORCH_SLOTS = frozenset(vars(nn.Module())) | {"training"}
"""What ``nn.Module.__init__`` puts in every module's ``__dict__`` (hooks, parameters...):
guarded by the rest of the guard, not as plain attributes."""


def _layout(tensor: torch.Tensor | None) -> tuple[Any, ...] | None:
    """What Python may branch on of a tensor's layout: shape, dtype, device, strides."""
    if tensor is None:
        return None
    strides = tensor.layout is torch.strided and tensor.stride()
    return (tensor.shape, tensor.dtype, tensor.device, tensor.layout, strides)


def _shown(layout: tuple[Any, ...] | None) -> str:
    return "none" if layout is None else f"{tuple(layout[0])} {layout[1]} strides {layout[4]}"


class _ClassView:
    """A module class's attributes as a mapping, looked up as ``self.NAME`` finds them (through
    the class's bases: a constant set later on a subclass shadows its base's)."""

    def __init__(self, klass: type) -> None:
        self.klass = klass

    def __getitem__(self, name: str) -> Any:
        try:
            return getattr(self.klass, name)
        except AttributeError:
            raise KeyError(name) from None

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self.klass, name, default)


class ModuleGuard:
    """The state of a set of modules (and their submodules) that a trace baked in.

    Checked before every compiled call, so :meth:`holds` is built from C-level
    ``map`` calls over dicts collected once: training flags, the total size of
    all hook dicts (a removal shrinks it), the ids of parameter and buffer
    objects, and torch's global hook-handle counter (every new hook anywhere
    advances it; only then are the hook ids themselves compared).
    """

    def __init__(
        self,
        roots: Iterable[nn.Module],
        hooks: bool = True,
        grads_read: Sequence[str] = (),
        skip: frozenset[tuple[int, str]] = frozenset(),
        layouts_read: Mapping[int, str] | None = None,
    ) -> None:
        """``skip``: (id of a module, attribute) pairs not checked (a counter the record pass
        did not read: ``_reads._unread``); ``layouts_read``: the ids of tensors whose layout
        Python read in the record pass -> where (``Unguardable.layout_reads``)."""
        self._skip = skip
        named: dict[int, tuple[str, nn.Module]] = {}
        for root in roots:
            for name, module in root.named_modules(prefix=type(root).__name__):
                named.setdefault(id(module), (name, module))
        self.scripted = ScriptedState([n for n in named.values() if scripted(n[1])])
        """TorchScript modules: their state lives in C++, read through torch's wrappers."""
        named = {k: n for k, n in named.items() if not scripted(n[1])}
        self.names = tuple(name for name, _ in named.values())
        """Names of the guarded modules, e.g. ``Sequential.0``."""
        self.modules = tuple(module for _, module in named.values())
        """Every module whose state is checked."""
        self.hooks = hooks
        """Whether hooks, parameters and buffers are checked (else training flags only)."""
        self._hook_dicts = (
            *(m.__dict__[name] for m in self.modules for name in MODULE_HOOK_DICTS),
            *_GLOBAL_HOOK_DICTS,
        )
        self._tensor_dicts = tuple(
            d
            for m in self.modules
            for d in (m.__dict__["_parameters"], m.__dict__["_buffers"])
            if d  # a tensor added to an empty dict later is not used by the traced program
        )
        self._tensor_metas = self._tensor_meta()
        self.grads_read = tuple(grads_read)
        """Where the traced Python read a tensor's ``requires_grad``: the path it took may
        depend on the parameters' (``if net.weight.requires_grad:``), so these are checked on
        every call (else only after a program fails, :meth:`moved`)."""
        self._grads = self._requires_grads() if self.grads_read else ()
        read = dict(layouts_read or {})  # (name, dict, key, where Python read it) of each
        held = {id(t) for t in chain.from_iterable(d.values() for d in self._tensor_dicts)}
        others = [w for i, w in getattr(layouts_read, "strides", {}).items() if i not in held]
        read.update(dict.fromkeys(held - read.keys(), others[0]) if others else {})  # LayoutReads
        self.laid_out = tuple(  # parameter or buffer whose layout each call checks (39c)
            (f"{owner}.{key}", d, key, read[id(t)]) for owner, m in zip(self.names, self.modules)
            for d in (m.__dict__["_parameters"], m.__dict__["_buffers"])
            for key, t in d.items() if t is not None and id(t) in read
        )  # fmt: skip
        self._layouts = self._layouts_now()
        self._classes = tuple(map(type, self.modules))
        self._parents = tuple(m for m in self.modules if m._modules)
        self._child_dict_ids = self._child_dict_identities()
        self._snapshot_children()
        self._snapshot_attributes()
        self._trainings = self._training_flags()
        self._sizes = self._hook_sizes()
        self._tensor_ids = self._tensor_identities()
        self._hook_ids = self._hook_keys()
        self._handle_counter = RemovableHandle.next_id
        self._filled = tuple(d for d in self._hook_dicts if d)
        """The hook dicts that held hooks when traced (others change only by growing)."""
        self._hook_items = self._filled_items()

    def _snapshot_children(self) -> None:
        """Which module object each submodule slot holds (``net.act = nn.Tanh()`` retraces)."""
        self._child_dicts = tuple(m.__dict__["_modules"] for m in self.modules if m._modules)
        self._children = self._child_identities()
        self._child_names = tuple(
            (owner, name, type(child).__name__, id(child))
            for owner, m in zip(self.names, self.modules)
            for name, child in m._modules.items()
        )

    def _snapshot_attributes(self) -> None:
        """Plain immutable attributes (``Dropout.p``, a temperature, ``self._scale``; torch's
        own bookkeeping excepted) and those of the user's module classes (``SCALE = 2.0`` read
        as ``self.SCALE``): traced in as constants."""
        attributes: list[tuple[Any, str, str]] = [
            (m.__dict__, name, owner) for owner, m in zip(self.names, self.modules)
            for name, value in m.__dict__.items()
            if name not in _TORCH_SLOTS and name not in PYTHONS_OWN
            and (immutable(value) or isinstance(value, _CODE)) and (id(m), name) not in self._skip
        ]  # fmt: skip
        attributes += [  # the registries themselves, by identity: m.__dict__.update(other's),
            (m.__dict__, name, owner)  # m.__setstate__(...) swaps in another module's tensors
            for owner, m in zip(self.names, self.modules)
            for name in _REGISTRIES if name in m.__dict__  # (a module pickled by an older torch)
        ]  # fmt: skip
        attributes += [  # Python attributes set on a parameter or buffer: m.weight.scale
            (t.__dict__, name, f"{owner}.{slot}")
            for owner, m in zip(self.names, self.modules)
            for slot, t in [*m._parameters.items(), *m._buffers.items()]
            if t is not None and t.__dict__
            for name, value in t.__dict__.items()
            if name not in PYTHONS_OWN and immutable(value)
        ]  # fmt: skip
        for klass in dict.fromkeys(type(m) for m in self.modules):
            view = _ClassView(klass)
            names = dict.fromkeys(
                name for base in klass.__mro__[: klass.__mro__.index(nn.Module)]
                if user_class(base)
                for name, value in vars(base).items()
                if name not in PYTHONS_OWN and immutable(value)
            )  # fmt: skip
            attributes += [(view, name, f"{klass.__qualname__} (class)") for name in names]
        self._attributes = tuple(attributes)
        by_dict: dict[int, tuple[Any, list[str]]] = {}
        for d, name, _ in self._attributes:
            by_dict.setdefault(id(d), (d, []))[1].append(name)
        self._attribute_getters = [
            (operator.itemgetter(*names), d) for d, names in by_dict.values()
        ]  # one C call per module
        self._attribute_values = self._attribute_snapshot()
        self._initial = {(id(d), name): d[name] for d, name, _ in self._attributes}
        self._instance_dicts = tuple(  # each module's attributes, parameters, buffers, children
            d for m in self.modules
            for d in (m.__dict__, m.__dict__["_parameters"], m.__dict__["_buffers"],
                      m.__dict__["_modules"])
        ) + tuple(  # then each parameter's and buffer's Python attributes: one set later
            t.__dict__ for d in self._tensor_dicts for t in d.values() if t is not None
        )  # (lin.weight.gain, read as getattr(w, "gain", 1.0)) retraces (probe 45b)  # fmt: skip
        self._instance_sizes = self._sizes_of_instance_dicts()

    def _sizes_of_instance_dicts(self) -> tuple[int, ...]:
        """How many attributes, parameters, buffers and submodules each module holds: one added
        later (``net.forward = other``, shadowing a method of the class; a buffer registered
        after the trace and read as ``getattr(self, "offset", None)``) retraces."""
        return tuple(map(len, self._instance_dicts))

    def _child_dict_identities(self) -> tuple[int, ...]:
        """Which dict holds each parent's submodules: ``del net[3]`` on a Sequential or a
        ModuleList builds a new one, which the other checks (collected once) would not see.
        Parents only (a module that gains its first child changes its registry's length)."""
        return tuple(map(id, map(_CHILDREN, self._parents)))

    def _training_flags(self) -> tuple[bool, ...]:
        return tuple(map(_training, self.modules))

    def _hook_sizes(self) -> int:
        # Adding a hook anywhere advances the handle counter, so a sum detects every
        # removal that is not paired with an addition.
        ours = MODULE_HOOK.handle_id is not None  # our record-pass hook, while a thread records
        return sum(map(len, self._hook_dicts)) - ours

    def _tensor_identities(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Which tensor each parameter and buffer slot holds, and the slots' names (a buffer
        renamed, ``register_buffer("hot", m.a); del m.a``, keeps the objects and the count)."""
        return (
            tuple(map(id, chain.from_iterable(map(dict.values, self._tensor_dicts)))),
            tuple(chain.from_iterable(self._tensor_dicts)),
        )

    def moved(self) -> bool:
        """Whether parameters or buffers changed dtype, device, shape or requires_grad since
        the trace.

        ``module.double()`` / ``.to(device)`` / ``param.data = new`` / ``requires_grad_()``
        keep the tensor objects and change these. A program then fails at its first op on them
        (inductor's programs check their inputs' sizes; engine ``compile``'s programs their
        parameters' ``requires_grad``); checked only then, not before every call (it would cost
        about half the guard). See NOTE [module guards]."""
        return self._tensor_meta() != self._tensor_metas

    def _tensor_meta(self) -> tuple[tuple[Any, Any, Any, bool] | None, ...]:
        # A slot may hold None (``Linear(bias=False)``, ``register_buffer(name, None)``).
        return tuple(
            None if t is None else _TENSOR_META(t)
            for t in chain.from_iterable(map(dict.values, self._tensor_dicts))
        )

    def _child_identities(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Which module each submodule slot holds, and the slots' names (a child renamed,
        ``net.off_b = net.b; del net.b``, a ModuleDict key replaced: a loop over
        ``named_children()`` that branches on names takes another path)."""
        return (
            tuple(map(id, chain.from_iterable(map(dict.values, self._child_dicts)))),
            tuple(chain.from_iterable(self._child_dicts)),
        )

    def _attribute_snapshot(self) -> list[Any]:
        try:
            return [get(d) for get, d in self._attribute_getters]
        except KeyError:  # an attribute deleted
            return []

    def _same_attributes(self, now: list[Any]) -> bool:
        """Whether the plain attributes are the objects traced, or values of the same types
        and bits (``canonical``). ``==`` called ``2`` and ``2.0``, ``-0.0`` and ``0.0``,
        ``True`` and ``1``, two orders of a frozenset equal, and raised on a tensor or array
        set in place of a number (probe round 35). Equal values in new objects
        (``m.p = 0.5`` again) are compared once, then by identity."""
        expected = self._attribute_values
        if len(now) != len(expected):
            return False
        if all(map(identical, now, expected)):
            return True
        if not all(map(strictly_same, now, expected)):
            return False
        self._attribute_values = now
        return True

    def _hook_keys(self) -> tuple[Any, ...]:
        ours = MODULE_HOOK.handle_id
        return tuple(tuple(k for k in d if k != ours) for d in self._hook_dicts)

    def _filled_items(self) -> tuple[tuple[Any, ...], ...]:
        """The hooks of the dicts that held some, in order, with their functions: a hook
        replaced under its key (``m._forward_hooks[k] = other``) or the hooks reordered
        (``move_to_end``) keep the count and the handle counter."""
        ours = MODULE_HOOK.handle_id
        return tuple(tuple(i for i in d.items() if i[0] != ours) for d in self._filled)

    def _layouts_now(self) -> tuple[Any, ...]:
        """The layout of each tensor of :attr:`_laid_out` (None: its slot emptied)."""
        return tuple(_layout(d.get(key)) for _, d, key, _ in self.laid_out)

    def _requires_grads(self) -> tuple[bool, ...]:
        return tuple(
            t.requires_grad
            for t in chain.from_iterable(map(dict.values, self._tensor_dicts))
            if t is not None
        )

    def holds(self) -> bool:
        """Whether the modules are still as they were traced."""
        if self._training_flags() != self._trainings:
            return False
        if self.scripted.named and not self.scripted.holds():
            return False
        if self.grads_read and self._requires_grads() != self._grads:
            return False
        if self.laid_out and self._layouts_now() != self._layouts:
            return False
        if tuple(map(type, self.modules)) != self._classes:  # m.__class__ = Other
            return False
        if self._parents and self._child_dict_identities() != self._child_dict_ids:
            return False
        if not self._same_attributes(self._attribute_snapshot()):
            return False
        if self._sizes_of_instance_dicts() != self._instance_sizes:
            return False
        if self._child_dicts and self._child_identities() != self._children:
            return False
        if not self.hooks:
            return True
        if self._hook_sizes() != self._sizes or self._tensor_identities() != self._tensor_ids:
            return False
        if RemovableHandle.next_id != self._handle_counter:  # a hook was added somewhere
            if self._hook_keys() != self._hook_ids:
                return False
            self._handle_counter = RemovableHandle.next_id  # not ours: skip this next time
        return not self._filled or self._filled_items() == self._hook_items

    def changed_attributes(self) -> list[tuple[nn.Module, str]]:
        """The modules' plain attributes whose values changed since the trace."""
        modules = {id(m.__dict__): m for m in self.modules}
        return [
            (modules[id(d)], attr)
            for d, attr, _ in self._attributes
            if id(d) in modules and attr not in _REGISTRIES
            and changed(self._initial[id(d), attr], d.get(attr, GONE))
        ]  # fmt: skip

    def describe_change(self) -> str:
        """What changed since the trace, e.g. ``module Sequential.2 training True -> False``."""
        for name, was, now_training in zip(self.names, self._trainings, self._training_flags()):
            if was != now_training:
                return f"module {name} training {was} -> {now_training}"
        if (script_change := self.scripted.describe_change()) is not None:
            return script_change
        if self.grads_read and self._requires_grads() != self._grads:
            return (
                "a parameter's requires_grad changed, and the function's Python reads "
                f"requires_grad (at {self.grads_read[0]})"
            )
        for name, module, klass in zip(self.names, self.modules, self._classes):
            if type(module) is not klass:
                return (f"module {name} is of class {type(module).__qualname__}, "
                        f"{klass.__qualname__} when traced")  # fmt: skip
        for module, ident in zip(self._parents, self._child_dict_ids):
            if id(module._modules) != ident:
                name = self.names[self.modules.index(module)]
                return f"module {name} holds its submodules in a new dict (del net[i]?)"
        kinds = ("attributes", "parameters", "buffers", "submodules")
        sizes = zip(self._instance_sizes, self._sizes_of_instance_dicts(), strict=True)
        for i, (traced, now) in enumerate(sizes):
            if traced != now and i >= 4 * len(self.modules):
                return "a parameter or buffer gained or lost a Python attribute (w.gain = 3.0?)"
            if traced != now:
                module_name, kind = self.names[i // 4], kinds[i % 4]
                return f"module {module_name} holds {now} {kind}, {traced} when traced"
        laid_out = zip(self.laid_out, self._layouts, self._layouts_now())
        for (name, _, _, where), was, now in laid_out:
            if was != now:  # a parameter restrided (channels_last) or retyped in place
                return f"{name}: layout {_shown(was)} -> {_shown(now)}, read at {where}"
        if self._tensor_meta() != self._tensor_metas:
            return (
                "parameters or buffers changed dtype, device, shape or requires_grad "
                "(module.double(), .to(), param.data = ..., requires_grad_()?)"
            )
        for d, attr, owner in self._attributes:
            old, value = self._initial[id(d), attr], d.get(attr, "<deleted>")
            if not changed(old, value):
                continue
            if attr in _REGISTRIES:
                return (f"module {owner} holds another {attr[1:]} dict (its __dict__ updated "
                        "from another module's, __setstate__, or the dict replaced)")  # fmt: skip
            return f"attribute {owner}.{attr}: {old!r} -> {value!r}"
        for owner, name, old_type, ident in self._child_names:
            module = next(m for n, m in zip(self.names, self.modules) if n == owner)
            child = module._modules.get(name)
            if child is None:
                return f"submodule {owner}.{name} ({old_type}) renamed or removed"
            if id(child) != ident:
                new = type(child).__name__
                return f"submodule {owner}.{name} replaced: {old_type} -> new {new}"
        if self.hooks and self._hook_keys() != self._hook_ids:
            keys = self._hook_keys()
            for i, (old_keys, new_keys) in enumerate(zip(self._hook_ids, keys)):
                if old_keys != new_keys:
                    owner = "global" if i >= 4 * len(self.modules) else self.names[i // 4]
                    return f"{MODULE_HOOK_DICTS[i % 4][1:]} of module {owner} changed"
        if self.hooks and self._filled_items() != self._hook_items:
            return "a hook was replaced under its key or the hooks reordered"
        if self.hooks and self._tensor_identities()[1] != self._tensor_ids[1]:
            return "parameters or buffers were renamed (register_buffer under another name?)"
        if self.hooks and self._tensor_identities() != self._tensor_ids:
            return (
                "parameters or buffers were replaced by new tensors (load_state_dict(assign=True)?)"
            )
        return "nothing"


def identical(now: Any, was: Any) -> bool:
    """The same object, or (the attributes of one module, read together) the same objects."""
    if now is was:
        return True
    return type(now) is tuple and type(was) is tuple and all(map(operator.is_, now, was))
