"""Stage 1 (reads), the record phase's watch on attributes that changed: counters no code reads.

The walk guards every attribute of an object of the user's, and the module guard every plain
attribute of a module: it cannot tell from the objects which ones the code reads. Ordinary
loops change some that nothing in the step reads (``model.num_updates += 1``,
``trainer.global_step += 1``, ``cfg.history.append(loss)``), and each such change retraced;
after 12 calls the step ran eagerly for good (probe rounds 26-27).

So when a call misses because such an attribute changed (:meth:`Unread.note`: a value or a
container's content under an attribute of an instance of a user class, or a plain attribute
of a user module), the retrace's record pass runs with the attribute's class watched
(:meth:`Unread.watching`: its ``__getattribute__`` wrapped for the pass). An attribute that
pass never reads on that object cannot have shaped what was traced from it, and the new
specialization does not guard it (:meth:`Unread.kept`, ``skip`` of the module guard);
other guards still decide the path, and a retrace for another reason watches it again. A
read of ``__dict__``, ``__getstate__`` or ``__reduce_ex__`` on the object (``vars(cfg)``,
``copy``, ``pickle``) counts as reading every attribute. Everything that reads an attribute
goes through ``__getattribute__`` (``getattr``, ``operator.attrgetter``, ``str.format``,
``match``, a library's C code) except ``object.__getattribute__(obj, name)``,
``inspect.getattr_static`` and a descriptor's ``__get__``: where the step's code spells or
holds those, every attribute stays guarded.
See NOTE [counters no code reads] in docs/design.md.
"""

from __future__ import annotations

import inspect
import sys
import threading
import types
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import nn

from .._compat import custom_op_gradients
from .._sources import OWN_DIR, is_user_file
from ._code_walk import codes
from ._records import GONE, Kind, Read, Step

__all__ = ["Unread", "reads_watched", "watchable"]

_WHOLE = frozenset(("__dict__", "__getstate__", "__reduce_ex__", "__reduce__", "__getattribute__"))
"""Read on a watched object, these read every attribute it has."""
_MODULE_FILE = inspect.getfile(nn.Module)
"""torch's ``nn.Module``, whose ``__getattr__`` and ``__setattr__`` read ``self.__dict__`` for
parameters, buffers and submodules only."""
_HEAP_TYPE = 1 << 9
"""``Py_TPFLAGS_HEAPTYPE``: a class made by a ``class`` statement."""
_MAX_WATCHED = 64
"""Attributes watched per function at most (the first ones that changed)."""
_LOCK = threading.Lock()


class Unread:
    """Per jitted function: the attributes that changed between calls and are watched in
    record passes, and which of them the last record pass did not read."""

    def __init__(self) -> None:
        self._watched: dict[tuple[int, str], Any] = {}
        """(id of the object, attribute name) -> the object (held: its guards hold it too)."""
        self.unread: frozenset[tuple[int, str]] = frozenset()
        """The watched attributes the last record pass did not read."""

    def note(
        self,
        reads: Iterable[Read],
        attributes: Iterable[tuple[nn.Module, str]],
        modules: Mapping[int, nn.Module],
    ) -> None:
        """Watch the attributes under which ``reads`` lie (Python guards that failed), and
        the modules' plain ``attributes`` that changed (the module guard's); ``modules``: by
        the id of their ``__dict__``."""
        for read in reads:
            found = _attribute_of(read, modules)
            if found is not None:
                self._watch(*found)
        for module, name in attributes:
            self._watch(module, name)

    def note_failed(self, specializations: Iterable[Any]) -> None:
        """:meth:`note` what failed in the guards of ``specializations`` (a call missed)."""
        for spec in specializations:
            python, module = spec.python_guard, spec.guard
            reads = [r for r in python.reads if not r.holds()] if python is not None else []
            changed = module.changed_attributes() if module is not None else []
            holders = {id(m.__dict__): m for m in module.modules} if module is not None else {}
            self.note(reads, changed, holders)

    def kept(self, reads: list[Read], modules: Mapping[int, nn.Module]) -> list[Read]:
        """``reads`` without those under an attribute the last record pass did not read
        (``modules`` by the id of their ``__dict__``)."""
        if not self.unread:
            return reads
        kept = []
        for read in reads:
            found = _attribute_of(read, modules)
            if found is None or (id(found[0]), found[1]) not in self.unread:
                kept.append(read)
        return kept

    def discard(self, reads: Iterable[Read], custom_calls: bool) -> None:
        """Keep every guard of this specialization (forget :attr:`unread`) where code that
        runs outside the record pass may read attributes (a custom function's backward, at
        the first backward: ``custom_calls``), or where the step's code reads past the watch
        (:data:`_BYPASS_NAMES`, :data:`_BYPASSES`)."""
        if not self.unread:
            return
        if custom_calls or _backwards_of_yours() or any(_spells_bypass(r.expected) for r in reads):
            self.unread = frozenset()

    def _watch(self, owner: Any, name: str) -> None:
        if isinstance(owner, type) or not watchable(type(owner)):
            return
        if len(self._watched) < _MAX_WATCHED:
            self._watched.setdefault((id(owner), name), owner)

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Run the block (the record pass) with the watched objects' classes reporting which
        watched attributes are read; :attr:`unread` is set after it."""
        if not self._watched:
            self.unread = frozenset()
            yield
            return
        read: set[tuple[int, str]] = set()
        whole: set[int] = set()
        try:
            with reads_watched(self._watched.values(), read, whole):
                yield
        finally:
            self.unread = frozenset(
                key for key in self._watched if key not in read and key[0] not in whole
            )


@contextmanager
def reads_watched(
    owners: Iterable[Any], read: set[tuple[int, str]], whole: set[int]
) -> Iterator[None]:
    """Run the block with the classes of ``owners`` noting in ``read`` (id, name) of each
    attribute read on them, and in ``whole`` the ids of those read whole (``vars(obj)``, or
    of a class that refuses the watch)."""
    owners = list(owners)
    idents, restore = {id(o) for o in owners}, []
    with _LOCK:
        for klass in {id(type(o)): type(o) for o in owners}.values():
            undo = _patch(klass, idents, read, whole)
            if undo is None:  # a class that refuses it: every attribute counts as read
                whole.update(id(o) for o in owners if type(o) is klass)
            else:
                restore.append(undo)
    try:
        yield
    finally:
        with _LOCK:
            for undo in reversed(restore):
                undo()


def watchable(klass: type) -> bool:
    """Every class in ``klass``'s MRO but ``object`` defined in Python (a heap type): C code
    of a built-in base (``SimpleNamespace``'s ``==`` and ``repr``) reads the instance's
    dict without ``__getattribute__``."""
    return all(k is object or k.__flags__ & _HEAP_TYPE for k in klass.__mro__)


def _backwards_of_yours() -> bool:
    """Whether an op of yours made with ``torch.library.custom_op`` has a gradient formula
    (``register_autograd``): it runs when a backward is traced, after the record pass."""
    gradients = custom_op_gradients()
    if gradients is None:  # a torch without the registry: assume there may be
        return True
    codes_of = (getattr(gradient, "__code__", None) for gradient in gradients)
    return any(code is not None and is_user_file(code.co_filename) for code in codes_of)


_BYPASS_NAMES = frozenset(("__getattribute__", "getattr_static", "__get__"))
"""Names through which code reads an attribute past its class's ``__getattribute__``:
``object.__getattribute__(cfg, "k")``, ``inspect.getattr_static(self, "k")``, a slot's
descriptor ``B.__dict__["k"].__get__(self, B)`` (probe round 35: all three dropped the
attribute's guard as unread)."""
_BYPASSES = (object.__getattribute__, inspect.getattr_static)
_BOUND_C = (types.MethodWrapperType, types.BuiltinMethodType)
"""The same, held under a name of the user's (``OGET = object.__getattribute__``)."""


def _spells_bypass(value: Any) -> bool:
    if any(value is bypass for bypass in _BYPASSES):
        return True
    if isinstance(value, _BOUND_C) and value.__name__ == "__getattribute__":
        return True  # getk = cfg.__getattribute__, held: getk("k") reads past the watch
    return isinstance(value, types.CodeType) and any(
        not _BYPASS_NAMES.isdisjoint(inner.co_names) for inner in codes(value)
    )


def _patch(klass: type, idents: set[int], read: set[tuple[int, str]], whole: set[int]) -> Any:
    """Wrap ``klass.__getattribute__`` to note reads on the objects ``idents``; the undo."""
    own = klass.__dict__.get("__getattribute__")
    inherited = next(k.__dict__["__getattribute__"] for k in klass.__mro__[1:]
                     if "__getattribute__" in k.__dict__)  # fmt: skip

    def watched(self: Any, name: str) -> Any:
        if id(self) in idents:
            frame = sys._getframe(1)
            while frame.f_back is not None and frame.f_code is watched.__code__:
                frame = frame.f_back  # another watch's wrapper around this one (the unread
                # attributes' and the overflow's, in one record pass): its caller's read
            caller = frame.f_code.co_filename
            if not caller.startswith(OWN_DIR):  # our record phase's own look at modules
                read.add((id(self), name))
                if name in _WHOLE and caller != _MODULE_FILE:  # nn.Module.__getattr__ reads
                    whole.add(id(self))  # self.__dict__["_parameters"]: not your attributes
        return (own or inherited)(self, name)

    try:
        type.__setattr__(klass, "__getattribute__", watched)
    except (TypeError, AttributeError):
        return None

    def undo() -> None:
        if own is None:
            type.__delattr__(klass, "__getattribute__")
        else:
            type.__setattr__(klass, "__getattribute__", own)

    return undo


def _attribute_of(read: Read, modules: Mapping[int, nn.Module]) -> tuple[Any, str] | None:
    """(object, name) of the last attribute step on ``read``'s path, or the module whose
    ``__dict__`` holds it, for a value or content read (objects are guarded by identity,
    tensors are inputs); None otherwise."""
    if read.kind not in (Kind.VALUE, Kind.CONTENT):
        return None
    source = read.source
    steps = [n for n, step in enumerate(source.path) if _named(step)]
    if not steps:
        module = modules.get(id(source.namespace)) if source.namespace is not None else None
        return None if module is None else (module, source.name)
    n = steps[-1]
    try:
        owner = source.above(n).get()
    except GONE:
        return None
    return owner, source.path[n].key


def _named(step: Step) -> bool:
    return (
        step.attribute
        and not (step.call or step.length or step.listed or step.text)
        and isinstance(step.key, str)
        and not step.key.startswith("__")
    )
