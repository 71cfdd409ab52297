"""Reads past the walk's limits (``_reads._overflow``): item 250 of a list of 300 stage objects
a loop reads, an entry of a dict of 1000 objects read by a computed key, node 40 of a linked
list, a value nine objects down. The record pass after the one that met them watches those
objects, and what it reads of them is guarded: a change retraces, never a stale value; what
the step does not read is not guarded. Every engine (shared suite)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import Counter, like_eager_then_retraced

import phi_torch_jit as ptj
from phi_torch_jit._reads._guard import PythonGuard
from phi_torch_jit._reads._records import Kind, Read, Source, Step

pytestmark = pytest.mark.all_engines


class Stage:
    def __init__(self, k: float) -> None:
        self.k = k
        self.name = f"stage {k}"


class Node:
    def __init__(self, value: float, after: Node | None) -> None:
        self.value = value
        self.after = after


STAGES = [Stage(1.0) for _ in range(300)]
TABLE = {i: Stage(1.0) for i in range(1000)}
KEY = 700
HEAD: Node | None = None
for _ in range(50):
    HEAD = Node(1.0, HEAD)
_LEVELS = [type(f"Level{i}", (), {}) for i in range(10)]
DEEP: Any = _LEVELS[9]()
DEEP.k = 1.0
for _klass in reversed(_LEVELS[:9]):
    _outer = _klass()
    _outer.child = DEEP
    DEEP = _outer


def through_the_stages(x: torch.Tensor) -> torch.Tensor:
    for stage in STAGES:
        x = x * stage.k
    return x


def by_a_computed_key(x: torch.Tensor) -> torch.Tensor:
    return x * TABLE[KEY].k


def along_the_links(x: torch.Tensor) -> torch.Tensor:
    node = HEAD
    while node is not None:
        x = x + node.value
        node = node.after
    return x


def nine_down(x: torch.Tensor) -> torch.Tensor:
    level = DEEP
    for _ in range(9):
        level = level.child
    return x * level.k


def _node(i: int) -> Node:
    node = HEAD
    for _ in range(i):
        assert node is not None
        node = node.after
    assert node is not None
    return node


def _deepest() -> Any:
    level = DEEP
    for _ in range(9):
        level = level.child
    return level


CASES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[], Any], str]] = {
    "a list of 300, item 250": (through_the_stages, lambda: STAGES[250], "k"),
    "a dict of 1000, by a computed key": (by_a_computed_key, lambda: TABLE[KEY], "k"),
    "a linked list of 50, node 40": (along_the_links, lambda: _node(40), "value"),
    "nine objects down": (nine_down, _deepest, "k"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_what_the_step_reads_past_the_walks_limits_is_guarded(case: str) -> None:
    step, owner, name = CASES[case]
    before = getattr(owner(), name)
    try:
        like_eager_then_retraced(ptj.jit(step), step, lambda: setattr(owner(), name, 2.0))
    finally:
        setattr(owner(), name, before)


def test_the_record_pass_after_the_one_that_met_the_limits_watches_and_builds() -> None:
    calls = Counter()

    def step(x: torch.Tensor) -> torch.Tensor:
        calls.forward += 1
        return by_a_computed_key(x)

    jitted = ptj.jit(step)
    x = torch.ones(3)
    jitted(x)
    assert (calls.forward, len(jitted.specializations)) == (1, 0)  # no guard yet: none built
    jitted(x)
    assert len(jitted.specializations) == 1
    jitted.wait_compiled()
    ran = calls.forward
    for _ in range(3):
        torch.testing.assert_close(jitted(x), step(x))
    assert calls.forward == ran + 3  # the three eager calls here only: the program served
    assert jitted.num_traces == 1


def test_what_the_step_does_not_read_past_the_limits_is_not_guarded() -> None:
    global KEY
    jitted = ptj.jit(by_a_computed_key)
    x = torch.ones(3)
    old = TABLE[KEY]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ptj.JitWarning)
            for change in (lambda: None, lambda: setattr(TABLE[900], "k", 5.0)):
                change()
                for _ in range(3):
                    torch.testing.assert_close(jitted(x), by_a_computed_key(x))
                jitted.wait_compiled()
            assert jitted.num_traces == 1  # TABLE[900] is not read (past the walk's 512 reads)
            TABLE[KEY] = Stage(3.0)  # the entry read, replaced
            torch.testing.assert_close(jitted(x), x * 3.0)
            KEY = 5
            torch.testing.assert_close(jitted(x), x * 1.0)
    finally:
        KEY, TABLE[700], TABLE[900].k = 700, old, 1.0


def test_an_attribute_added_past_the_limits_and_read_with_a_default_retraces() -> None:
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * getattr(TABLE[KEY], "scale", 1.0)

    try:
        like_eager_then_retraced(ptj.jit(scaled), scaled, lambda: setattr(TABLE[KEY], "scale", 4.0))
    finally:
        del TABLE[KEY].scale


def test_namespaces_containers_and_tensors_past_the_limits_are_guarded_as_they_are() -> None:
    """What no record pass can watch (a ``SimpleNamespace``'s fields are read without
    ``__getattribute__``, a list's items by subscript) is guarded whole instead: a namespace
    of plain values by content, a container by identity and length, a value in it by value,
    a tensor in it as an input of the program (changed in place, seen)."""
    spaces = [SimpleNamespace(k=1.0, name="n") for _ in range(400)]
    nested = [SimpleNamespace(inner=SimpleNamespace(v=1.0)) for _ in range(300)]
    tensors = [torch.ones(3) for _ in range(600)]

    def through_spaces(x: torch.Tensor) -> torch.Tensor:
        for space in spaces:
            x = x * space.k
        return x

    def nested_read(x: torch.Tensor) -> torch.Tensor:
        return x * nested[280].inner.v

    def summed(x: torch.Tensor) -> torch.Tensor:
        for t in tensors:
            x = x + t
        return x

    like_eager_then_retraced(ptj.jit(through_spaces), through_spaces,
                             lambda: setattr(spaces[350], "k", 2.0))  # fmt: skip
    like_eager_then_retraced(ptj.jit(nested_read), nested_read,
                             lambda: setattr(nested[280].inner, "v", 3.0))  # fmt: skip
    like_eager_then_retraced(ptj.jit(summed), summed, lambda: tensors[550].add_(1.0), traces=1)


def test_what_is_too_big_to_guard_past_the_limits_is_said_unguarded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Past ``MAX_LEAVES`` reads of what cannot be watched (a dict of 1500 lists, each with
    three numbers and a namespace, read by a computed key): not guarded, and said so (the log
    at the trace, explain()), with no partial guard paid for at every call."""
    lists = {i: [1.0, 2.0, float(i), SimpleNamespace(a=1)] for i in range(1500)}

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * lists[1200][1]

    jitted = ptj.jit(step)
    with caplog.at_level(logging.WARNING, logger="phi_torch_jit"):
        for _ in range(2):
            torch.testing.assert_close(jitted(torch.ones(3)), torch.ones(3) * 2.0)
    assert "not guarded" in jitted.explain()  # a documented limit, said: docs/guarded.md
    assert any("fields" in record.getMessage() for record in caplog.records)
    assert len(jitted.specializations[-1].python_guard or ()) < 1024


class _Counted:
    reads = 0

    def __init__(self, after: Any) -> None:
        self.after = after

    def __getattribute__(self, name: str) -> Any:
        if name == "after":
            _Counted.reads += 1
        return object.__getattribute__(self, name)


def test_the_guard_reads_a_shared_prefix_of_paths_once() -> None:
    head: Any = None
    for _ in range(40):
        head = _Counted(head)
    reads = []
    for depth in range(1, 40):
        source = Source(f"node {depth}", "here", holder=head, path=(Step(True, "after"),) * depth)
        reads.append(Read(source, Kind.IDENTITY, source.get()))
    guard = PythonGuard(reads)
    _Counted.reads = 0
    assert guard.holds()
    assert _Counted.reads == 39  # one per node, not 780 (each path from the head)
    _node_38 = reads[37].source.get()
    _node_38.after = _Counted(None)  # node 39 replaced
    assert not guard.holds()


class _Base:
    k = 1.0

    def __init__(self, v: float) -> None:
        self.v = v


class _Late(_Base):  # its objects lie only past the walk's limits
    k = 2.0


class _Tagged(dict):  # type: ignore[type-arg]
    def __init__(self, **entries: float) -> None:
        super().__init__(**entries)
        self.tag = "t"


SHARED = _Base(2.0)
ALIASED = [_Base(1.0) for _ in range(600)]
ALIASED[595] = ALIASED[599] = SHARED  # one object at two places
_ROW = [_Base(1.0) for _ in range(30)]
GRID = [_ROW] * 30  # one row list thirty times
ORDERED = {f"g{i}": {j: _Base(1.0 + j) for j in range(40)} for i in range(30)}
CLASSES = [_Base(1.0) for _ in range(590)] + [_Late(1.0) for _ in range(10)]
TAGGED = [_Tagged(v=1.0) for _ in range(600)]


def _aliased(x: torch.Tensor) -> torch.Tensor:
    for o in ALIASED:
        x = x + o.v
    return x


def _grid(x: torch.Tensor) -> torch.Tensor:
    for row in GRID:
        for o in row:
            x = x + o.v
    return x


def _ordered(x: torch.Tensor) -> torch.Tensor:
    for inner in ORDERED.values():
        for o in inner.values():
            x = x * 0.5 + o.v  # the order counts
    return x


def _class_data(x: torch.Tensor) -> torch.Tensor:
    for o in CLASSES:
        x = x + type(o).k * o.v
    return x


def _tagged(x: torch.Tensor) -> torch.Tensor:
    for t in TAGGED:
        x = x + t["v"]
    return x


def _reorder() -> None:
    inner = ORDERED["g29"]
    inner[0] = inner.pop(0)


STRUCTURE: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[], None]]] = {
    "an object at a second place, replaced there": (
        _aliased, lambda: ALIASED.__setitem__(599, _Base(100.0))),
    "a row shared thirty times, one replaced": (
        _grid, lambda: GRID.__setitem__(29, [_Base(2.0) for _ in range(30)])),
    "a dict's order": (_ordered, _reorder),
    "class data read by type(o).k": (_class_data, lambda: setattr(_Late, "k", 10.0)),
    "an object's class swapped": (_class_data, lambda: setattr(CLASSES[595], "__class__", _Base)),
    "the items of a dict subclass with attributes": (
        _tagged, lambda: TAGGED[599].__setitem__("v", 100.0)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(STRUCTURE))
def test_the_structure_past_the_limits_is_guarded(case: str) -> None:
    """Probe round 31: what holds the objects past the limits, not only what they hold."""
    step, change = STRUCTURE[case]
    snapshot = ([*ALIASED], [*GRID], {k: dict(v) for k, v in ORDERED.items()}, _Late.k,
                [*CLASSES], [dict(t) for t in TAGGED])  # fmt: skip
    try:
        like_eager_then_retraced(ptj.jit(step), step, change, x=torch.zeros(1))
    finally:
        ALIASED[:], GRID[:], _Late.k, CLASSES[:] = (
            snapshot[0],
            snapshot[1],
            snapshot[3],
            snapshot[4],
        )
        for key, inner in snapshot[2].items():
            ORDERED[key] = inner
        for t, entries in zip(TAGGED, snapshot[5], strict=True):
            t.update(entries)
        CLASSES[595].__class__ = _Late


class _Stage:
    def __init__(self, w: float) -> None:
        self.w = w


_STAGES = [_Stage(1.0) for _ in range(200)]


def _applied(stage: _Stage, x: torch.Tensor) -> torch.Tensor:
    return x * stage.w


def _staged(x: torch.Tensor) -> torch.Tensor:
    for stage in _STAGES:
        x = _applied(stage, x)
    return x


def test_an_attribute_past_the_limits_changed_again_and_again_stays_guarded() -> None:
    """Probe round 35d: the retrace after a change watches the changed attribute (is it still
    read?) and the objects past the limits (what is read of them?) in one pass; the one
    watch's wrapper around the other's hid the step's read from the inner one, the attribute
    counted as unread and the second change was served stale."""
    jitted, x = ptj.jit(_staged), torch.ones(2)
    try:
        for w in (1.0, 2.0, 3.0, 1.0):
            _STAGES[5].w = w
            for _ in range(2):
                torch.testing.assert_close(jitted(x), _staged(x))
    finally:
        _STAGES[5].w = 1.0
    assert jitted.num_traces == 3  # back to 1.0: the first specialization serves
