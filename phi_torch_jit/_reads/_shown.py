"""Stage 1 (reads), attribute paths: objects that show what others hold (NOTE [attribute
paths]): a dict's view held apart from its dict, a ``slice``'s bounds, a ``UserDict``'s dict,
a ``ChainMap``'s maps, ``os.environ``'s data, what an ``operator.methodcaller`` binds. The
walk (:func:`._fields.fields`) goes on from the paths given here.
"""

from __future__ import annotations

import collections
import functools
import operator
import os
from typing import Any

from ._records import LENGTH, LISTED, Step

__all__ = ["VIEWS", "shown", "called_with", "got_names"]

VIEWS: tuple[type, ...] = (type({}.keys()), type({}.values()), type({}.items()))
_ITEMS: type = type({}.items())
_HELD_AT: tuple[tuple[Any, tuple[str, ...]], ...] = (
    ((collections.UserDict, collections.UserList), ("data",)),  # the dict or list it wraps
    (collections.ChainMap, ("maps",)),  # every map, a lower one too (c.get("k"))
    (type(os.environ), ("_data",)),  # os.environ under another name: what it holds
    (slice, ("start", "stop", "step")),  # x[SL]: a bound that is an array or an object
)
"""Objects that hold another one, and the attributes where it is."""


def shown(value: Any) -> list[Step | tuple[Step, ...]] | None:
    """Paths to what ``value`` holds or shows, if it is such an object (else None). A view's
    entries are reached by position through the view (``tuple(VALUES)[i]``; an item's key
    and value, ``tuple(ITEMS)[i][1]``), with how many it shows: its ``mapping`` is a new
    proxy at every read, and the objects, tensors or iterators in it were not walked (probe
    42c). A plain view's content is compared whole as well (``_python``)."""
    if isinstance(value, VIEWS):
        pairs = (0, 1) if isinstance(value, _ITEMS) else ()
        count = len(value)  # type: ignore[arg-type]
        entries: list[Step | tuple[Step, ...]] = [LENGTH]
        for i in range(count):
            at = (LISTED, Step(False, i))
            entries += [(*at, Step(False, j)) for j in pairs] if pairs else [at]
        return entries
    under = next((names for kind, names in _HELD_AT if isinstance(value, kind)), None)
    return None if under is None else [Step(True, name) for name in under]


_REDUCED = Step(True, "__reduce__", call=True)


def got_names(value: Any) -> tuple[str, ...]:
    """The last attribute name of each path an ``operator.attrgetter`` reads (``"environ"``
    of ``attrgetter("os.environ")``); none for anything else."""
    if not isinstance(value, operator.attrgetter):
        return ()
    return tuple(n.split(".")[-1] for n in value.__reduce__()[1] if isinstance(n, str))


def called_with(
    caller: operator.methodcaller | operator.itemgetter,
) -> list[Step | tuple[Step, ...]]:
    """Paths to what a ``methodcaller`` binds, each item of the new tuples ``__reduce__``
    makes: ``(methodcaller, (name, *args))``, or with keywords ``(partial(methodcaller, name,
    **keywords), args)``; to the items an ``itemgetter`` gets: ``(itemgetter, items)`` (an
    object whose ``__index__`` reads its state, a slice's bound: probe 53a)."""
    reduced: Any = caller.__reduce__()
    made, args = reduced[0], reduced[1]
    paths: list[Step | tuple[Step, ...]] = [(_REDUCED, Step(False, 1), Step(False, i))
                                            for i in range(len(args))]  # fmt: skip
    if isinstance(made, functools.partial):
        bound = (_REDUCED, Step(False, 0))
        paths += [(*bound, Step(True, "args"), Step(False, i)) for i in range(len(made.args))]
        paths += [(*bound, Step(True, "keywords"), Step(False, k)) for k in made.keywords]
    return paths
