"""Stage 1 (reads): the Python state a specialization depends on, and what it must not touch.

A trace bakes every Python value the function reads: a closure ``dt``, a global config, which
object a global name is. After the record pass, :func:`collect_reads` walks the *user* code the
call can reach (``_reachable``: not torch's, ours, the standard library's or an installed
package's) and turns the globals and closure variables that code reads into :class:`Read`
records: immutable values are guarded by value, small containers of them by content, other
objects by identity, and tensors become *inputs* of the compiled program, so reassigning them
and updating them in place are both seen. A changed value retraces, naming the variable, where
it is read and old -> new. The walk is static (bytecode): the record pass pays nothing for it.

What no compiled program can repeat is noted while the record pass runs by
:mod:`._unguardable`. See NOTE [Python reads] in docs/design.md.
"""

from __future__ import annotations

import builtins
import functools
import sys
import types
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..errors import eager_if_it_raises
from ._callable_attributes import opaque_held
from ._class_fields import an_mro, classes_held
from ._code_walk import (
    IMPORTERS,
    MAX_DEPTH,
    Shadowing,
    added_builtins,
    chains_spelled,
    iterates_globals,
    modules_imported,
    names_looked_up,
    names_read,
    names_used,
    user_class,
    user_module,
)
from ._content import SIZED, buffer_read, plain_container, snapshot, strict
from ._custom_bodies import held_by_identity, roots_read_by
from ._environment import ABC_TOKEN, environment_sources, holds_environment_reader
from ._fields import (
    INSTANCE_DICT,
    TREE_DEPTH,
    computed,
    depth,
    fields,
    has_attributes,
    runs_code,
    shows_content,
    tensor_attributes,
)
from ._function_state import annotation_sources, function_sources
from ._guard import PythonGuard
from ._held import describe_callable, held_objects
from ._imported import imported_sources, registered_sources
from ._kinds import MAX_ARRAY, big_array, kind_of
from ._library_holders import holder_sources, names_held
from ._library_methods import library_objects_read
from ._library_state import answer_of, library_held, library_sources, settings_of_held
from ._module_attributes import library_class_sources, module_sources
from ._overflow import Overflow, overflowed
from ._reachable import reach
from ._records import (
    GONE,
    LENGTH,
    LISTED,
    Kind,
    Read,
    Source,
    Step,
    array_copy,
    canonical,
    immutable,
    same_value,
    tensor_meta,
)
from ._shown import VIEWS
from ._type_tests import type_test_sources

__all__ = ["Read", "Kind", "Source", "PythonGuard", "collect_reads", "same_value", "immutable",
           "user_module", "describe_callable"]  # fmt: skip

_MAX_FIELDS = 512
"""Attribute-path reads under one global or closure object, its whole tree (a list of a
hundred stage objects iterated by the step fits; a guard of 413 reads took 46 us here)."""


_SUBCLASSES = Step(True, "__subclasses__")
_LISTED_SUBCLASSES = Step(True, "__subclasses__", call=True)
"""``Term.__subclasses__()``: a new list on every call, guarded by its length and items."""


def _add_chains(
    reads: dict[Any, Read], key: Any, source: Source, chains: set[tuple[Step, ...]]
) -> None:
    """Each prefix of each chain read from ``source``, without descending further: under
    objects guarded by identity only (values and contents are guarded whole), never into a
    module (the module guard and the wrapper own its state)."""
    for chain in chains:
        parent, child = key, source
        for index, step in enumerate(chain[: MAX_DEPTH + 2]):
            above = reads.get(parent)
            if above is None or above.kind is not Kind.IDENTITY:
                break
            if isinstance(above.expected, nn.Module) or runs_code(above.expected, step):
                break  # a property of yours: what it reads is guarded, it is not run
            if step == INSTANCE_DICT and isinstance(above.expected, type):
                break  # K.__dict__: a new proxy each read; the class's walk has its entries
            owner, parent, child = child, (parent, step), child.child(step)
            try:
                value = child.get()
            except GONE:
                break
            if isinstance(value, type) and user_class(value):  # settings.Inner: its data
                _add(reads, parent, child)  # and methods, walked like any class read
                continue
            if library_held(value):  # K.backend.enabled: torch.backends.mkldnn held
                for path, below in library_sources(child, None, "", (chain[index + 1 :],)):
                    _add(reads, (parent, path), below)
                break
            if isinstance(value, torch.Tensor) and computed(above.expected, step):
                break  # normal.mean: made from what the object holds (its inputs), each call
            if step == _SUBCLASSES:  # Term.__subclasses__(): a registry of plugins
                _add_subclasses(reads, parent, owner, [_MAX_CLASSES])
                break
            if callable(value) and not isinstance(value, (nn.Module, torch.Tensor)):
                if (answer := answer_of(value, child)) is not None:  # Cfg.threads()
                    _add(reads, (parent, "answer"), answer)
                break  # a method or function (a new bound method on every read): code, not data
            _add(reads, parent, child, budget=[-1])  # -1: not descended


@eager_if_it_raises
def collect_reads(
    fn: Any, modules: Sequence[nn.Module], arguments: Sequence[Any] = (),
    imported: Mapping[str, str] | None = None,
    module_reads: Mapping[tuple[str, str], str] | None = None,
    state_dicts: Collection[int] = (), type_tests: Mapping[tuple[type, type], bool] | None = None,
    role: str = "an argument",
    customs: Sequence[Any] = (), overflow: Overflow | None = None,
) -> list[Read]:  # fmt: skip
    """The globals and closure variables the user code reachable from ``fn`` and the
    recorded ``modules`` reads, each once (see the module docstring). ``arguments``: callable
    objects, bound methods and partials passed to this call (keyed by identity, so the
    specialization holds them): their state is walked like the jitted callable's.
    ``imported``: the user's modules the record pass saw imported -> where (by any name);
    ``module_reads``: (module, attribute) the record pass saw read -> where;
    ``state_dicts``: the ids of the modules whose ``state_dict()`` ran; ``type_tests``: the
    (ABC, class) pairs it tested (:mod:`._type_tests`). ``fn`` None:
    only ``arguments`` are walked, named ``role`` (the hooks of :mod:`._hooks`).
    ``customs``: the custom functions' callables the record pass saw called: tensors their
    code reads are guarded by identity too (:mod:`._custom_bodies`). ``overflow``: what lies
    past the walk's limits, and what the record pass read of it (:mod:`._overflow`)."""
    reads: dict[Any, Read] = {}
    _add_modules(reads, modules, state_dicts)
    for argument in arguments:
        if isinstance(argument, types.ModuleType):  # your configuration module, passed in
            _add_imported(reads, {argument.__name__: "a module (an argument)"})
        elif not isinstance(argument, (functools.partial, types.MethodType, types.FunctionType)):
            label = f"{type(argument).__name__} object ({role})"
            _add(reads, (id(argument), "argument"), Source(label, describe_callable(argument),
                                                          holder=argument))  # fmt: skip
    roots = [fn, *arguments] if fn is not None else list(arguments)
    for key, source in [h for r in roots for h in held_objects(r, _role(r, fn, role))]:
        _add(reads, key, source)
    shadowing: dict[int, Shadowing] = {}
    reached = _add_module_reads(reads, module_reads or {}, shadowing)
    walked = (reached_code := reach([*roots, *modules, *reached])).functions
    libraries: list[types.ModuleType] = []
    for function in walked:
        code = function.__code__
        for key, source in function_sources(function):  # its code, defaults, attributes
            _add(reads, key, source)
        globals_read, cells_read = names_read(code)
        namespace = function.__globals__
        chains = chains_spelled(code)
        looked_up = dict.fromkeys(names_looked_up(function) - globals_read.keys(),
                                  code.co_firstlineno)  # fmt: skip
        if iterates_globals(function):  # how many globals there are: one defined later
            where = f"{code.co_filename}:{code.co_firstlineno}"
            source = Source("len(globals())", where, holder=namespace, path=(LENGTH,))
            _add(reads, (id(namespace), LENGTH), source)  # and their order (a name deleted
            order = Source("list(globals())", where, holder=namespace, path=_IN_ORDER)  # and
            _add(reads, (id(namespace), "order"), order)  # defined again: last; probe 54)
        for name, line in {**globals_read, **looked_up}.items():
            space = namespace if name in namespace else added_builtins(name)
            if space is not namespace:  # a builtin, or undefined: until the module defines it
                _undefined(shadowing, namespace, name)
            if space is None and name not in vars(builtins) and name.isidentifier():
                _undefined(shadowing, vars(builtins), name, "builtins")  # nor builtins.K = 5
            if space is not None:  # a global, or a name set on builtins (builtins.SETTING)
                if isinstance(space.get(name), types.ModuleType) and library_held(space[name]):
                    libraries.append(space[name])  # helper(torch): mod.my_cfg read locally
                source = Source(f"global {name}", f"{code.co_filename}:{line}", space, name)
                _add(reads, (id(space), name), source)
                _add_chains(reads, (id(space), name), source, chains.get((False, name), set()))
                for path, below in library_sources(source, code, name):  # torch's settings
                    _add(reads, ((id(space), name), path), below)
        found = modules_imported(code).items()
        _add_imported(reads, {name: f"{code.co_filename}:{line}" for name, line in found})
        for key, source in environment_sources(code, holds_environment_reader(function)):
            _add(reads, key, source)
        for name, cell in zip(code.co_freevars, function.__closure__ or ()):
            if name in cells_read:
                location = f"{code.co_filename}:{cells_read[name]}"
                source = Source(f"closure {name}", location, cell=cell)
                _add(reads, id(cell), source)
                _add_chains(reads, id(cell), source, chains.get((True, name), set()))
                for path, below in library_sources(source, code, name, cell=True):
                    _add(reads, (id(cell), path), below)
    if reached_code.left and walked and (key := (id(walked[0]), "__code__")) in reads:
        reads[key] = replace(reads[key], unguarded=reached_code.said())  # explain(), logged
    for ident, holder in shadowing.items():
        _add(reads, (ident, "shadowing"), holder.source())
    _add_imported(reads, imported or {})
    for key, source in type_test_sources(type_tests or {}):  # isinstance(x, ABC)'s answers
        _add(reads, key, source)
    held = [*modules, *(r.expected for r in reads.values() if r.kind is not Kind.TENSOR)]
    held += libraries
    for key, source in settings_of_held(held, walked):  # for mod in BACKENDS: mod.enabled
        _add(reads, key, source)
    for key, source in library_objects_read(reads, walked):  # sched.get_last_lr()
        _add(reads, key, source)
    spelled = frozenset().union(*(names_used(f.__code__) for f in walked))  # self.GAIN on
    nets = (m for m in held if isinstance(m, nn.Module))  # nn.Linear, LIN.SCALE
    for key, source in library_class_sources(nets, spelled):
        _add(reads, key, source)
    held_names = names_held(walked, (r.expected for r in reads.values()))  # getattr(m, "k")
    if not IMPORTERS.isdisjoint(spelled):  # sys.modules[NAME], import_module(NAME)
        _add_imported(reads, {n: "sys.modules, by a name read" for n in held_names
                              if n in sys.modules})  # fmt: skip
    for key, source in list(holder_sources(reads, spelled, held_names)):  # a library's holder
        _add(reads, key, source)
    if "__subclasses__" in spelled:  # c.__subclasses__() of a class in a variable (a walk
        for key, read in [(k, r) for k, r in reads.items() if r.kind is Kind.IDENTITY]:
            if isinstance(read.expected, type) and user_class(read.expected):  # of the tree)
                _add_subclasses(reads, (key, _SUBCLASSES), read.source, [_MAX_CLASSES])
    for key, source in annotation_sources(walked, reads.values(), spelled):  # get_type_hints
        _add(reads, key, source)
    if customs:
        held_by_identity(reads, roots_read_by(customs))
    if overflow is not None:  # past the walk's limits: what the record pass saw read there
        overflow.add_to(reads, _add)
    return list(reads.values())


def _role(root: Any, fn: Any, role: str) -> str:
    return "the jitted" if root is fn else role


def _add_subclasses(reads: dict[Any, Read], key: Any, source: Source, left: list[int]) -> None:
    """How many subclasses the class at ``source`` has (a new list on each call), each walked,
    and theirs where they are the user's (``for s in c.__subclasses__()`` walked recursively:
    a grandchild defined later, probe 48), ``left[0]`` classes in all."""
    listed = source.child(_LISTED_SUBCLASSES)
    _add(reads, (key, LENGTH), listed.child(LENGTH))
    for i, klass in enumerate(listed.get()[: max(left[0], 0)]):
        left[0] -= 1
        _add(reads, (key, i), listed.child(Step(False, i)), [_MAX_FIELDS])
        if user_class(klass):
            _add_subclasses(reads, (key, i), listed.child(Step(False, i)), left)


_IN_ORDER = (Step(True, "keys", call=True), LISTED)
"""A namespace's names, in the order a loop over it sees them."""

_MAX_CLASSES = 64
"""Classes of one subclass tree guarded (``Base.__subclasses__()``, theirs...)."""


def _add_imported(reads: dict[Any, Read], imported: Mapping[str, str]) -> None:
    """What the modules a function imports hold (:mod:`._imported`)."""
    for key, source in imported_sources(imported):
        _add(reads, key, source)


def _undefined(
    shadowing: dict[int, Shadowing], namespace: dict[str, Any], name: str, label: str = "globals"
) -> None:
    """Guard that ``namespace`` does not define ``name`` (as when traced)."""
    shadowing.setdefault(id(namespace), Shadowing(namespace, label)).names.add(name)


def _add_module_reads(
    reads: dict[Any, Read], module_reads: Mapping[tuple[str, str], str],
    shadowing: dict[int, Shadowing],
) -> list[Any]:  # fmt: skip
    """The attributes of the user's modules the record pass saw read (reached by a computed
    name, ``sys.modules[__name__].SCALE``), each guarded like a global, and those it looked
    for and did not find (``getattr(settings, "SCALE", 1.0)``), guarded to stay undefined;
    returns the code among them (functions, classes), for the walk."""
    reached, registered = [], set()
    for (name, attribute), where in module_reads.items():
        module = sys.modules.get(name)
        if module is None or not user_module(module):
            continue
        if attribute not in vars(module):
            _undefined(shadowing, vars(module), attribute, f"module {name}")
            continue
        namespace = vars(module)
        if id(module) not in registered:  # one scan of sys.modules per module
            registered.add(id(module))
            for key, source in registered_sources(module, where):
                _add(reads, key, source)
        _add(reads, (id(namespace), attribute), Source(f"{name}.{attribute}", where, namespace,
                                                       attribute))  # fmt: skip
        if callable(namespace[attribute]):
            reached.append(namespace[attribute])
    return reached


def _bound_anew(value: Any) -> bool:
    """A bound method of a Python function, not of a tensor: ``s.go`` is a new object at each
    read, equal to the last while its object and function are the same (both walked)."""
    return isinstance(value, types.MethodType) and not isinstance(value.__self__, torch.Tensor)


def _add_modules(
    reads: dict[Any, Read], modules: Sequence[nn.Module], state_dicts: Collection[int] = ()
) -> None:
    """The plain attributes of ``modules``, and their classes of yours: their methods
    (``Net.forward = other``) and data (``type(self).K``, which a forward may change); what
    decides the ``state_dict()`` of those in ``state_dicts`` (ids)."""
    for module in modules:
        for key, source in module_sources(module, id(module) in state_dicts):
            _add(reads, key, source)
    for klass in {id(type(m)): type(m) for m in modules if user_class(type(m))}.values():
        label = f"class {klass.__qualname__}"
        _add(reads, ("class", id(klass)), Source(label, klass.__module__, holder=klass))


def _add(
    reads: dict[Any, Read], key: Any, source: Source, budget: list[int] | None = None,
    lineage: tuple[tuple[type, int, int], ...] = (), slack: int = 0,
) -> None:  # fmt: skip
    """Add the read of ``source`` and, under an object guarded by identity, its attribute
    paths: ``budget`` (shared by one root's whole tree) bounds how many. ``lineage``: the
    types above it, their depths and identities (an object met again above it, a cycle, is not
    walked again); an object of a type met above it (a linked list's
    ``node.next``, a tree's children) is walked as deep as the first one (``slack``), up to
    ``_LINKED_DEPTH``: a loop that follows such links reads every node."""
    if key in reads:
        return
    try:
        value = source.get()
    except GONE:  # an empty cell: not read after all
        return
    kind = kind_of(value)
    if isinstance(value, types.FunctionType) and "registry" in value.__dict__:  # dispatch
        _add(reads, ("abc",), ABC_TOKEN)  # by type: ABC.register() changes where
    if strict(kind, value):  # in canonical form: types, signs and order count
        form, expected = canonical(value)
        source = source.child(form)
    else:
        copies = {Kind.TENSOR: tensor_meta, Kind.CONTENT: snapshot, Kind.ARRAY: array_copy}
        expected = copies.get(kind, lambda v: v)(value)
    stored = Kind.VALUE if kind is Kind.IDENTITY and _bound_anew(value) else kind  # s.go:
    reads[key] = Read(source, stored, expected)  # equal (same object, same function), walked
    if (answer := answer_of(value, source)) is not None:  # torch.get_num_threads, held
        _add(reads, (key, "answer"), answer)
    for i, held in enumerate(opaque_held(value) if kind is Kind.IDENTITY else ()):
        label = f"{source.label} (what it calls)"  # cmp_to_key(order.cmp): order's state
        _add(reads, (key, "held", i), Source(label, source.location, holder=held), budget)
    if kind is Kind.IDENTITY and (held := buffer_read(value)) is not None:
        _add(reads, (key, "bytes"), source.child(held), budget)  # what it shows now
    if kind is Kind.IDENTITY and isinstance(value, SIZED):  # a deque of tensors grown too
        _add(reads, (key, LENGTH), source.child(LENGTH), budget)
    if kind is Kind.IDENTITY and shows_content(value):  # d.values() held, class T(dict)
        copied = source.child(Step(True, "mapping")) if isinstance(value, VIEWS) else source
        copied = copied.child(Step(True, "copy", call=True))  # a plain dict, list or set
        if plain_container(copied.get()):  # compared whole; else entries (fields), by identity
            _add(reads, (key, "content"), copied, budget)
    if kind is Kind.IDENTITY and isinstance(value, nn.Module):  # called or a container only
        _add_modules(reads, list(value.modules()))
    for step in tensor_attributes(value) if kind is Kind.TENSOR else ():  # W.scale = 2.0
        steps = step if isinstance(step, tuple) else (step,)
        _add(reads, (key, steps), functools.reduce(Source.child, steps, source), budget)
    if kind is Kind.VALUE and type(value) is tuple and not an_mro(source.path):  # T = (A, 1):
        for i in classes_held(value):  # A's data, walked (equal tuples, probe 51)
            _add(reads, (key, i), source.child(Step(False, i)), budget, lineage, slack)
    if kind is not Kind.IDENTITY:
        return
    if big_array(value):  # say so (explain): its content is not compared at every call
        where = f"{value.size} elements (arrays of up to {MAX_ARRAY} are compared)"
        reads[key] = replace(reads[key], unguarded=where)
        return
    if any(i == id(value) for _, _, i in lineage):
        return  # a cycle (a bound method back to its object): walked above, where it is
    level = depth(source.path)
    first = next((d for t, d, _ in lineage if t is type(value)), None)
    if first is not None and level < _LINKED_DEPTH:
        slack = max(slack, level - first)
    try:
        steps_under = fields(value)
    except Exception:  # an object's own __getattr__/__len__ rules: not walked
        steps_under = []
    if level - slack >= TREE_DEPTH:  # past it, what the record pass saw read; else said
        # (explain; a class's or a module's data is walked where it is reached as such)
        if steps_under and not isinstance(value, (type, types.ModuleType)):
            if not overflowed(source, steps_under):
                where = f"{len(steps_under)} fields ({TREE_DEPTH} levels down, the walk's depth)"
                reads[key] = replace(reads[key], unguarded=where)
    else:
        budget = [_MAX_FIELDS] if budget is None else budget
        if has_attributes(value):  # an attribute added later (shadowing a method, or read
            names = source.child(INSTANCE_DICT).child(LENGTH)  # with a getattr default)
            budget[0] -= 1 if budget[0] > 0 else 0
            _add(reads, (key, "attributes"), names, budget)
        if isinstance(value, type):  # likewise on a class of yours or its bases (Base.k = 5.0
            for i, base in enumerate(value.__mro__):  # read as getattr(obj, "k", 2.0))
                if user_class(base):
                    names = source.child(_MRO).child(Step(False, i)).child(INSTANCE_DICT)
                    _add(reads, (key, "class attributes", i), names.child(LENGTH), budget)
        for n, step in enumerate(steps_under):
            if budget[0] < 0:  # a chain's step: the root's own walk covers what is under it
                break
            if budget[0] == 0:  # past it, what the record pass saw read; else said (explain)
                left = f"{len(steps_under) - n} of its {len(steps_under)} fields (a tree walks "
                if not overflowed(source, steps_under[n:]):
                    reads[key] = replace(reads[key], unguarded=f"{left}{_MAX_FIELDS})")
                break
            budget[0] -= 1
            steps = step if isinstance(step, tuple) else (step,)
            child = source
            for each in steps:
                child = child.child(each)
            place = ("class", id(type(value))) if steps[0].key == "__class__" else (key, step)
            below = (*lineage, (type(value), level, id(value)))
            _add(reads, place, child, budget, below, slack)  # a class: once for all its objects


_MRO = Step(True, "__mro__")

_LINKED_DEPTH = 32
"""How deep links between objects of one type are followed (each read's path is fetched from
its root on every call: 512 reads of 32 steps cost about 0.5 ms)."""
