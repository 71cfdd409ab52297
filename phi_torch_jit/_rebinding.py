"""Puts a traced input where the step reads a tensor, for the trace, and exactly back after.

A tensor the step reads from Python state (a global, a closure cell, ``self.W``,
``TABLE["w"]``) becomes an input of the compiled program: while the wrapper is traced, the
place it is read from holds the traced input instead (NOTE [Python reads]). That place is
where the read *found* the tensor, which is not always the object the read went through:

* ``self.W`` where ``W`` is a class attribute (of the instance's class or a base class;
  ``type(self).W``, ``super().W``): the class holds it. Set on the instance, the input went
  into the instance's ``__dict__`` and stayed there after the trace, shadowing the class
  attribute for good (probe 36a: rebinding ``Scale.W`` was then seen by nobody);
* a slot (``__slots__``): its descriptor holds it;
* an instance whose class defines ``__setattr__`` (a frozen dataclass, a config that ignores
  or logs writes), a ``dict`` or ``list`` subclass with its own ``__setitem__``: the user's
  code ran twice per trace, or refused the write and left the tensor unguarded; the
  instance's ``__dict__``, ``dict``'s and ``list``'s own storage are written instead;
* a ``collections.ChainMap``: the first of its maps that holds the key (a write goes to
  ``maps[0]``, where the tensor was not).

Each rebinding returns how to undo it, exactly: what was there before is put back where it
was, and a place that held nothing (an entry a ``__missing__`` answered) is emptied again.
Modules keep their tensors in their own registries and are left to ``nn.Module``'s own
``__setattr__``. A place that cannot be rebound faithfully (a property's value, an
attribute ``__getattr__`` computes) makes the step run eagerly, warned.
"""

from __future__ import annotations

import collections
import types
from collections.abc import Callable
from typing import Any

from torch import nn

from ._reads import Source
from .errors import RunEagerly

__all__ = ["rebind"]

Undo = Callable[[], None]


def rebind(source: Source, value: Any) -> Undo:
    """Put ``value`` where ``source``'s read found its tensor; returns the undo."""
    if not source.path:
        old = source.get()
        source.set(value)
        return lambda: source.set(old)
    owner = source.above(-1).get()
    step = source.path[-1]
    if step.attribute:
        return _attribute(owner, step.key, value, source)
    return _item(owner, step.key, value, source)


def _attribute(owner: Any, key: str, value: Any, source: Source) -> Undo:
    if isinstance(owner, nn.Module):  # its registries, through its own __setattr__
        old = getattr(owner, key)
        setattr(owner, key, value)
        return lambda: setattr(owner, key, old)
    if isinstance(owner, type):
        return _on_class(owner, key, value, source)
    try:
        own = object.__getattribute__(owner, "__dict__")
    except AttributeError:
        own = None
    held = _MISSING
    for cls in type(owner).__mro__:  # as Python looks it up: a data descriptor of the class
        held = cls.__dict__.get(key, _MISSING)  # (a slot, a property) before the instance's
        if held is not _MISSING:  # __dict__, which holds a same-named entry in vain
            break
    if isinstance(held, types.MemberDescriptorType):  # a slot
        before = held.__get__(owner, type(owner))
        held.__set__(owner, value)
        return lambda: held.__set__(owner, before)
    data_descriptor = held is not _MISSING and hasattr(type(held), "__set__")
    if not data_descriptor and type(own) is dict and key in own:
        return _in_dict(own, key, value)
    if held is not _MISSING and not hasattr(type(held), "__get__"):
        return _on_class(type(owner), key, value, source)
    raise RunEagerly(
        f"it reads a tensor ({source.label}) that its object's code computes (a property, "
        "__getattr__): a compiled program cannot take it as an input; keep the tensor in an "
        "attribute or pass it as an argument to have it compiled"
    )


def _on_class(cls: type, key: str, value: Any, source: Source) -> Undo:
    """The class in ``cls``'s MRO that holds ``key`` (a class attribute read through a
    subclass stays its base class's)."""
    for holder in cls.__mro__:
        if key in holder.__dict__:
            before = holder.__dict__[key]
            try:
                type.__setattr__(holder, key, value)
            except TypeError as error:  # a builtin or extension class
                raise RunEagerly(
                    f"it reads a tensor ({source.label}) kept on a class that cannot be "
                    "changed; pass it as an argument to have it compiled"
                ) from error
            return lambda: type.__setattr__(holder, key, before)
    raise RunEagerly(
        f"it reads a tensor ({source.label}) that its class's code computes; pass it as an "
        "argument to have it compiled"
    )


def _item(owner: Any, key: Any, value: Any, source: Source) -> Undo:
    if isinstance(owner, collections.ChainMap):
        for mapping in owner.maps:
            if key in mapping:
                return _item(mapping, key, value, source)
    if isinstance(owner, dict):
        return _in_dict(owner, key, value)
    if isinstance(owner, list):
        before = list.__getitem__(owner, key)
        list.__setitem__(owner, key, value)
        return lambda: list.__setitem__(owner, key, before)
    before = owner[key]
    owner[key] = value
    return lambda: owner.__setitem__(key, before)


def _in_dict(mapping: dict[Any, Any], key: Any, value: Any) -> Undo:
    """``dict``'s own storage, past a subclass's ``__setitem__``; an entry that was not
    there (``__missing__`` answered the read) is removed again."""
    if not dict.__contains__(mapping, key):
        dict.__setitem__(mapping, key, value)
        return lambda: dict.__delitem__(mapping, key)
    before = dict.__getitem__(mapping, key)
    dict.__setitem__(mapping, key, value)
    return lambda: dict.__setitem__(mapping, key, before)


_MISSING = object()
