"""The guard stage: what a jitted step reads of Python state, how each read is guarded, and
what the step changes beside its results. The one place that says what is guarded and why.

A compiled program bakes every Python value it was traced with. Whatever the step (and every
user function it calls) reads is therefore either *guarded* (checked before each compiled call;
a change retraces, naming the read, where it happens, old -> new), made a *program input*, or
the call runs *eagerly* with one ``JitWarning`` naming why. Nothing read is assumed constant
without ``explain()`` saying so.

==========================================  ================================  =================
read                                         how                               where
==========================================  ================================  =================
a global or closure variable of user code    by value (numbers, strings,       ``_python``
(the function, what its closures, globals,   dtypes), by content (small
partials, bound ``self`` and the user's      containers, NumPy arrays), by
own modules name), attribute and subscript   identity (other objects); a
chains under it (``cfg.alpha``,              tensor is a program input
``settings.TABLE["drag"][1]``)
a loop over a container of user objects      the container's length and each   ``_python``
(``for st in stages: ... st.w``)             item's read attributes
objects of user classes past the walk's      what the next record pass reads   ``_overflow``
limits (512 paths, 7 levels: item 250 of     of them, each at its path         (record phase)
300, node 40 of a linked list)
the code and defaults of the functions run   code by identity, defaults by     ``_python``
(``f.__code__ = g.__code__``)                value
the process environment (``os.environ``,      by content, where user code       ``_python``
``os.getenv``)                               names ``environ`` or ``getenv``
an iterator or generator the step advances   eager, one warning (its items     ``_python``
(``next(forcing)``)                          change every call)
code of the user's a library or C keeps      walked as the user's code where   ``_class_registries``
and calls for the step (a pytree node's      the walk meets the class or the
flatten, a ``register_kl`` function, a       ``ctypes`` value
``ctypes`` callback)
a dict's view held apart (``d.values()``),   entries by position, and how      ``_shown``
a ``slice`` with an array or object bound    many; the bounds, as any value
a random generator or a clock under any      eager, one warning (a new value   ``_kinds``
name (``from random import random``,         on every call)
``rng.normal``, ``from time import time``)
what the step changes (counters, appended    snapshot before/after the record  ``_mutations``
lists, attributes of held objects; what the  pass; repeated after compiled
hooks of the modules known before change)    calls or eager with a warning
arguments written in place, and how the      version counters and storage      ``_written_inputs``
arguments share memory                       aliasing, part of the key
a tensor read as a Python value in traced    a per-call value guard, or a      ``_value_guards``
code (``float(t)``, ``t.item()``, ``if t``)  program input                     (trace phase)
what the modules' hooks read (their          as a callable argument's; what    ``_hooks``
closures, ``self``, globals)                 a hook changes: ``_mutations``
module state (training flags, hooks,         ``ModuleGuard``, checked per      ``_guards``
parameter identity)                          call                              (stage 5)
a user module imported by a computed name    its public data, as a global's    ``_modules_seen``
(``import_module(PREFIX + "cfg")``)           (noted in the record pass)        (record phase)
an attribute of a user module read by a       as a global (noted in the record  ``_modules_seen``
name built at run time (``sys.modules[        pass); functions read there are   (record phase)
__name__].X``, ``eval`` of built source)      walked
a name looked for and not found when traced   that the namespace still does     ``_python``,
(``except NameError``, ``globals().get(K)``,  not define it (one C call per     ``_modules_seen``
``getattr(settings, K, 1.0)``, a builtin)     namespace)
small containers whose ``==`` hides what a    a canonical form (``marshal``):    ``_content``
program reads (a dict's order, ``2`` vs      types, float bits, order
``2.0``, ``-0.0``, ``1`` vs ``True``)
what a library object's methods that user    the plain values their bytecode   ``_library_methods``
code calls read of it (``sched.get_last_lr   reads from ``self``, by value;
()``, ``len(subset)``)                       its objects, by identity
the cache of a function of yours            ``cache_info()``: misses, size    ``_cached_calls``
(``functools.lru_cache``): cleared, or      by value, hits not lower; each    (record phase)
a result changed in place                   result returned, as read objects
an attribute that changed between calls      watched in the retrace's record   ``_unread``
(a counter: ``model.num_updates += 1``)      pass; not guarded if it is unread  (record phase)
random draws, clocks, files, grad-mode       noted in the record pass: eager   ``_unguardable``
changes, ``backward()``, tensor hooks;       with one warning, or guarded;     (record phase)
Python reading ``requires_grad``             the module guard checks it
==========================================  ================================  =================

Modules: ``_records`` the records (``Source``, ``Step``, ``Kind``, ``Read``: where a read value
lives and how it is guarded; plain data, a leaf); ``_code_walk`` the static walk over user code
(names and attribute chains each code object reads); ``_reachable`` the functions a call can
reach; ``_module_attributes`` what the modules a call ran hold that the module guard does not
compare; ``_held`` what a jitted callable holds besides code (a partial's arguments, a method's
``self`` or ``cls``); ``_python`` turns those reads into ``Read`` records and checks them
(``PythonGuard``); ``_kinds`` how each value is guarded (and which values draw anew);
``_content`` how a container of plain values is compared; ``_class_fields`` what a class of
yours holds as data (a dataclass's fields too); ``_cached_calls`` the caches of
cached functions and what they returned; ``_library_methods`` what a
library's methods read of their own objects; ``_unread`` the attributes that changed
and the retrace did not read; ``_overflow`` what the step reads past the walk's limits;
``_hooks`` what the modules' hooks read; ``_environment`` the process's environment, command
line and ``abc`` registrations that code names; ``_custom_bodies`` tensors a custom function's
compiled body holds as constants (guarded by identity too);
``_mutations`` the side effects of the step; ``_written_inputs`` arguments written in place.
docs/guarded.md is the user's version of this table (NOTE [Python reads], NOTE [attribute
paths] in docs/design.md).
"""

from __future__ import annotations

from ._cached_calls import CachedCalls
from ._python import Kind, PythonGuard, Read, Source, collect_reads

__all__ = ["CachedCalls", "Kind", "PythonGuard", "Read", "Source", "collect_reads"]
