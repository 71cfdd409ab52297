"""Stage 1 (reads): the user's modules a step imports while it runs, and objects of yours
registered in ``sys.modules`` as modules.

A module imported inside a function (``import settings as s``), or by a name computed at run
time (seen by the record pass), is read through a local: no global or chain names it. Which
module ``sys.modules`` holds under that name is guarded by identity, and its public data like
globals. An object of a class of yours registered as a module (``sys.modules[NAME] =
Config()``, then ``sys.modules[NAME].k``, ``importlib.import_module(NAME).k``) is walked like
an object the step reads (probe 53a: its attributes were not guarded).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ._code_walk import user_class, user_module
from ._records import Source

__all__ = ["imported_sources", "registered_sources"]


def imported_sources(imported: Mapping[str, str]) -> Iterator[tuple[Any, Source]]:
    """(key, source) of what the modules ``imported`` name (-> where) hold: which object the
    name is in ``sys.modules``, and a module's public data."""
    for name, where in imported.items():
        module = sys.modules.get(name)
        if not isinstance(module, types.ModuleType) and user_class(type(module)):
            yield ("module", name), Source(f"sys.modules[{name!r}]", where, sys.modules, name)
            continue
        if module is None or not user_module(module):
            continue
        yield from registered_sources(module, where)
        namespace = vars(module)
        for attribute, value in list(namespace.items()):
            if attribute.startswith("_") or isinstance(value, (types.ModuleType, type)):
                continue
            if callable(value) and not isinstance(value, (torch.Tensor, nn.Module)):
                continue  # functions: code (their globals are walked where they are called)
            yield (id(namespace), attribute), Source(f"{name}.{attribute}", where, namespace,
                                                     attribute)  # fmt: skip


def registered_sources(module: types.ModuleType, where: str) -> Iterator[tuple[Any, Source]]:
    """Every name ``sys.modules`` holds ``module`` under, by identity: the step reached it by
    a name computed at run time (``import_module(NAME)``), maybe not its own."""
    for key, value in list(sys.modules.items()):
        if value is module:
            yield ("module", key), Source(f"module {key}", where, sys.modules, key)
