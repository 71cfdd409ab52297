"""Global state of libraries that the step reads (_reads._library_state): torch's settings read
through its functions (``torch.get_num_threads()``, ``torch.is_anomaly_enabled()``) and
switches kept as module attributes (``torch.backends.mkldnn.enabled``). Libraries' modules are
not walked, so until these were guarded every engine baked what they said at the first call
(the step then kept one branch or one factor whatever the script set later)."""

from __future__ import annotations

import collections
import functools
import itertools
import json
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from helpers import like_eager_then_retraced
from torch import get_num_threads, nn
from torch.backends import mkldnn

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines


def _by_threads(x: torch.Tensor) -> torch.Tensor:
    return x * torch.get_num_threads()


def _by_threads_imported(x: torch.Tensor) -> torch.Tensor:
    return x * get_num_threads()


def _helper_reads_anomaly_mode(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if torch.is_anomaly_enabled() else x * 3


def _by_anomaly_mode_in_a_helper(x: torch.Tensor) -> torch.Tensor:
    return _helper_reads_anomaly_mode(x) + 1


def _by_matmul_precision(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if torch.get_float32_matmul_precision() == "high" else x * 3


def _by_mkldnn_switch(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if torch.backends.mkldnn.enabled else x * 3


def _by_mkldnn_switch_imported(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if mkldnn.enabled else x * 3


def _by_tf32_switch(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if torch.backends.cuda.matmul.allow_tf32 else x * 3


def _closure_over_torch() -> Callable[[torch.Tensor], torch.Tensor]:
    import torch as t

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * t.get_num_threads()

    return step


def _by_a_default_reader(x: torch.Tensor, read: Any = torch.get_num_threads) -> torch.Tensor:
    return x * read()


READERS = {"threads": torch.get_num_threads}
PARTIAL_READER = functools.partial(torch.get_num_threads)


class _Settings:
    threads = staticmethod(torch.get_num_threads)


def _by_a_reader_in_a_dict(x: torch.Tensor) -> torch.Tensor:
    return x * READERS["threads"]()


def _by_a_partial_reader(x: torch.Tensor) -> torch.Tensor:
    return x * PARTIAL_READER()


def _by_a_reader_as_class_attribute(x: torch.Tensor) -> torch.Tensor:
    return x * _Settings.threads()


class _Backend:
    flags = torch.backends.mkldnn


_Held = collections.namedtuple("_Held", "backend scale")
HELD_IN_A_NAMEDTUPLE = _Held(torch.backends.mkldnn, 1.0)
HELD_IN_A_DEQUE = collections.deque([torch.backends.mkldnn])


def _by_a_module_in_a_namedtuple(x: torch.Tensor) -> torch.Tensor:
    backend = HELD_IN_A_NAMEDTUPLE.backend
    return x * 2 if backend.enabled else x * 3


def _by_a_module_in_a_deque(x: torch.Tensor) -> torch.Tensor:
    for backend in HELD_IN_A_DEQUE:
        x = x * 2 if backend.enabled else x * 3
    return x


def _by_a_namedtuple_default(x: torch.Tensor, held: Any = HELD_IN_A_NAMEDTUPLE) -> torch.Tensor:
    return x * 2 if held.backend.enabled else x * 3


BACKENDS = (torch.backends.mkldnn,)
W = torch.linspace(-1.0, 1.0, 9).reshape(3, 3)


def _by_a_literal_getattr(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if getattr(torch.backends.mkldnn, "enabled") else x * 3  # noqa: B009


def _by_a_module_held_by_a_class(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if _Backend.flags.enabled else x * 3


def _by_a_loop_over_modules(x: torch.Tensor) -> torch.Tensor:
    for backend in BACKENDS:
        x = x * 2 if backend.enabled else x * 3
    return x


def _by_a_default_module(x: torch.Tensor, backend: Any = torch.backends.mkldnn) -> torch.Tensor:
    return x * 2 if backend.enabled else x * 3


class _Configured(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backend = torch.backends.mkldnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if self.backend.enabled else x * 3


def _by_math_sdp(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if torch.backends.cuda.math_sdp_enabled() else x * 3


def _in_autocast(x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu"):
        return x @ W  # its dtype is the process's autocast dtype


def _by_autocast_dtype(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if torch.get_autocast_dtype("cpu") == torch.float16 else x * 3


def _math_sdp_switched() -> Iterator[None]:
    before = torch.backends.cuda.math_sdp_enabled()
    torch.backends.cuda.enable_math_sdp(not before)
    yield
    torch.backends.cuda.enable_math_sdp(before)


def _autocast_dtype() -> Iterator[None]:
    before = torch.get_autocast_dtype("cpu")
    torch.set_autocast_dtype("cpu", torch.float16 if before != torch.float16 else torch.bfloat16)
    yield
    torch.set_autocast_dtype("cpu", before)


def _threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1 if before > 1 else 2)
    yield
    torch.set_num_threads(before)


def _anomaly_mode() -> Iterator[None]:
    torch.autograd.set_detect_anomaly(True)
    yield
    torch.autograd.set_detect_anomaly(False)


def _matmul_precision() -> Iterator[None]:
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if before != "high" else "highest")
    yield
    torch.set_float32_matmul_precision(before)


def _mkldnn_off() -> Iterator[None]:
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = not before
    yield
    torch.backends.mkldnn.enabled = before


def _tf32_switched() -> Iterator[None]:
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = not before
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


CASES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[], Iterator[None]]]] = {
    "torch.get_num_threads()": (_by_threads, _threads),
    "get_num_threads() imported by name": (_by_threads_imported, _threads),
    "torch.is_anomaly_enabled() in a helper": (_by_anomaly_mode_in_a_helper, _anomaly_mode),
    "torch.get_float32_matmul_precision()": (_by_matmul_precision, _matmul_precision),
    "torch.backends.mkldnn.enabled": (_by_mkldnn_switch, _mkldnn_off),
    "mkldnn.enabled imported": (_by_mkldnn_switch_imported, _mkldnn_off),
    "torch.backends.cuda.matmul.allow_tf32": (_by_tf32_switch, _tf32_switched),
}
HELD: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "torch in a closure cell": _closure_over_torch(),
    "a reader as a parameter's default": _by_a_default_reader,
    "a reader in a dict": _by_a_reader_in_a_dict,
    "a partial of a reader": _by_a_partial_reader,
    "a reader as a class's staticmethod": _by_a_reader_as_class_attribute,
}


def _follows_the_setting(
    step: Callable[[torch.Tensor], Any], change: Callable[[], Iterator[None]]
) -> Any:
    """Three calls, the setting changed (``change`` restores it when resumed again), three
    calls: each like eager code, one retrace (``helpers.like_eager_then_retraced``)."""
    changed = change()
    jitted = ptj.jit(step)
    try:
        like_eager_then_retraced(jitted, step, lambda: next(changed))
    finally:
        next(changed, None)
    return jitted


@pytest.mark.parametrize("case", list(CASES))
def test_a_torch_setting_the_step_reads_is_guarded(case: str) -> None:
    """The script changes the setting between calls: the step follows it as eagerly (one
    retrace), on every engine."""
    jitted = _follows_the_setting(*CASES[case])
    assert f"{case.split(' ')[0].split('(')[0]}" in jitted.explain()


REACHED: dict[str, tuple[Callable[[torch.Tensor], Any], Callable[[], Iterator[None]]]] = {
    "getattr with a literal name": (_by_a_literal_getattr, _mkldnn_off),
    "a module held by a class": (_by_a_module_held_by_a_class, _mkldnn_off),
    "a loop over a global tuple of modules": (_by_a_loop_over_modules, _mkldnn_off),
    "a module as a parameter's default": (_by_a_default_module, _mkldnn_off),
    "a module held by an nn.Module": (_Configured(), _mkldnn_off),
    "a module in a namedtuple, read through a local": (_by_a_module_in_a_namedtuple, _mkldnn_off),
    "a module in a deque, iterated": (_by_a_module_in_a_deque, _mkldnn_off),
    "a module in a namedtuple as a parameter's default": (_by_a_namedtuple_default, _mkldnn_off),
    "a reader named ..._enabled": (_by_math_sdp, _math_sdp_switched),
    "autocast entered in the step": (_in_autocast, _autocast_dtype),
    "torch.get_autocast_dtype('cpu')": (_by_autocast_dtype, _autocast_dtype),
}


@pytest.mark.parametrize("case", list(REACHED))
def test_a_setting_read_through_a_module_held_or_named_otherwise_is_guarded(case: str) -> None:
    """torch's module reached through state of yours rather than by its global name (the
    names your code spells are looked up on it), ``getattr`` with a literal name, readers
    named ``..._enabled``, and the dtype ``torch.autocast("cpu")`` inside the step casts to
    (``torch.set_autocast_dtype``; its output's dtype changes too)."""
    _follows_the_setting(*REACHED[case])


@pytest.mark.parametrize("case", list(HELD))
def test_a_settings_reader_held_or_reached_by_a_closure_is_guarded(case: str) -> None:
    """The reader reached another way than a global module's path: the walk meets the
    function itself as a value (or torch in a cell) and guards what it answers."""
    _follows_the_setting(HELD[case], _threads)


def _asks_with_arguments(x: torch.Tensor) -> torch.Tensor:
    y = x * 2 if torch.is_tensor(x) and torch.is_floating_point(x) else x
    return y + float(torch.is_autocast_enabled("cpu"))


def test_functions_that_need_arguments_are_not_called_by_the_guard() -> None:
    """``torch.is_tensor(x)`` and ``torch.is_floating_point(x)`` need their argument: not
    settings. ``torch.is_autocast_enabled()`` is asked without its argument only where that
    does not warn (deprecated in some torch releases); the step compiles once and warns
    nothing (warnings are errors in this suite)."""
    jitted = ptj.jit(_asks_with_arguments)
    for _ in range(4):
        x = torch.randn(3)
        torch.testing.assert_close(jitted(x), _asks_with_arguments(x))
    assert jitted.num_traces == 1
    assert "is_tensor" not in jitted.explain() and "is_floating_point" not in jitted.explain()


def _library_constants(x: torch.Tensor) -> Any:
    return (x * torch.pi).to(torch.float64)


def test_torchs_own_names_of_types_are_not_listed_as_reads() -> None:
    """``torch.float64`` is torch's name of a type (not listed); ``torch.pi`` is a plain value
    read by a path, guarded like a switch (it never changes)."""
    jitted = ptj.jit(_library_constants)
    x = torch.randn(3)
    torch.testing.assert_close(jitted(x), _library_constants(x))
    assert "torch.float64" not in jitted.explain()
    assert "torch.pi" in jitted.explain()


# Code and data of yours kept on torch's modules, classes and objects (probe round 24)
_K = [1.0]


def _scaled(t: torch.Tensor) -> torch.Tensor:
    return t * _K[0]


def _doubled(t: torch.Tensor) -> torch.Tensor:
    return t * 2.0 * _K[0]


def _by_a_tensor_method(x: torch.Tensor) -> torch.Tensor:
    return x.probe_scaled() + 1.0  # type: ignore[attr-defined]


def _by_a_function_on_torch(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.probe_act(x) + 1.0  # type: ignore[attr-defined]


def _by_a_dict_on_torch(x: torch.Tensor) -> torch.Tensor:
    return x * torch.probe_cfg["k"]  # type: ignore[attr-defined]


_LOGGER = __import__("logging").getLogger("phi_torch_jit.tests.library_state")


def _by_a_dict_on_a_logger(x: torch.Tensor) -> torch.Tensor:
    return _LOGGER.probe_hooks["scale"](x) + 1.0  # type: ignore[attr-defined]


def _by_a_dict_of_functions_on_torch(x: torch.Tensor) -> torch.Tensor:
    return torch.probe_ops["op"](x)  # type: ignore[attr-defined]


def _by_a_list_of_functions_on_json(x: torch.Tensor) -> torch.Tensor:
    for callback in json.probe_callbacks:  # type: ignore[attr-defined]
        x = callback(x)
    return x


def _by_an_object_on_torch(x: torch.Tensor) -> torch.Tensor:
    return torch.probe_solver.step(x)  # type: ignore[attr-defined]


def _by_a_dict_on_a_library_class(x: torch.Tensor) -> torch.Tensor:
    return json.JSONEncoder.probe_registry["op"](x)  # type: ignore[attr-defined]


class _Euler:
    def __init__(self) -> None:
        self.k = 0.1

    def step(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.k * x


YOURS_ON_TORCH: dict[str, tuple[Callable[..., Any], Callable[[], None]]] = {
    "a dict of functions on torch, an entry replaced": (
        _by_a_dict_of_functions_on_torch,
        lambda: torch.probe_ops.__setitem__("op", _doubled),  # type: ignore[attr-defined]
    ),
    "a list of functions on json, one appended": (
        _by_a_list_of_functions_on_json,
        lambda: json.probe_callbacks.append(_doubled),  # type: ignore[attr-defined]
    ),
    "an object of yours on torch": (
        _by_an_object_on_torch,
        lambda: setattr(torch.probe_solver, "k", 0.7),  # type: ignore[attr-defined]
    ),
    "a dict of functions on a library's class": (
        _by_a_dict_on_a_library_class,
        lambda: json.JSONEncoder.probe_registry.__setitem__("op", _doubled),  # type: ignore[attr-defined]
    ),
    "a method set on torch.Tensor": (_by_a_tensor_method, lambda: _K.__setitem__(0, 3.0)),
    "a function set on torch.nn.functional": (
        _by_a_function_on_torch,
        lambda: _K.__setitem__(0, 3.0),
    ),
    "that function rebound": (
        _by_a_function_on_torch,
        lambda: setattr(torch.nn.functional, "probe_act", _doubled),
    ),
    "a dict set on torch": (
        _by_a_dict_on_torch,
        lambda: torch.probe_cfg.__setitem__("k", 3.0),  # type: ignore[attr-defined]
    ),
    "a dict of functions on a logger": (_by_a_dict_on_a_logger, lambda: _K.__setitem__(0, 3.0)),
}


@pytest.mark.parametrize("case", list(YOURS_ON_TORCH))
def test_code_and_data_of_yours_kept_on_torch_are_guarded(case: str) -> None:
    """A method set on ``torch.Tensor`` (``x.scaled()``), a function set on a torch module
    (``F.my_act``), a dict set there (``torch.my_cfg["k"]``), a dict of functions on a
    logger; dicts and lists of functions and objects of yours on torch's and the standard
    library's modules and classes: reached only through a library's module, class or object,
    their code was not walked and their content not guarded (probe rounds 24 and 25 found
    each baked on every engine). Functions are walked as yours and guarded by identity,
    containers by content or entry by entry, objects by their attributes."""
    step, change = YOURS_ON_TORCH[case]
    torch.Tensor.probe_scaled = _scaled  # type: ignore[attr-defined]
    torch.nn.functional.probe_act = _scaled  # type: ignore[attr-defined]
    torch.probe_cfg = {"k": 1.0}  # type: ignore[attr-defined]
    _LOGGER.probe_hooks = {"scale": _scaled}  # type: ignore[attr-defined]
    torch.probe_ops = {"op": _scaled}  # type: ignore[attr-defined]
    json.probe_callbacks = [_scaled]  # type: ignore[attr-defined]
    torch.probe_solver = _Euler()  # type: ignore[attr-defined]
    json.JSONEncoder.probe_registry = {"op": _scaled}  # type: ignore[attr-defined]
    try:
        like_eager_then_retraced(ptj.jit(step), step, change)
    finally:
        _K[0] = 1.0
        del torch.Tensor.probe_scaled  # type: ignore[attr-defined]
        del torch.nn.functional.probe_act  # type: ignore[attr-defined]
        del torch.probe_cfg  # type: ignore[attr-defined]
        del _LOGGER.probe_hooks  # type: ignore[attr-defined]
        del torch.probe_ops, json.probe_callbacks, torch.probe_solver  # type: ignore[attr-defined]
        del json.JSONEncoder.probe_registry  # type: ignore[attr-defined]


class _Gained(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.probe_gain  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["self of a subclass", "an instance", "a list", "an object"])
def test_data_of_yours_kept_on_a_torch_module_class_is_guarded(how: str) -> None:
    """``nn.Linear.GAIN = 2.0`` read as ``self.GAIN`` in a subclass's forward or as
    ``lin.GAIN`` of a torch module, a list or an object of yours kept there (probe 44b): the
    module guard compares the class attributes of your classes only, and the walk did not
    read torch's classes. Their data the walked code spells is guarded."""
    torch.manual_seed(0)
    net, lin = _Gained(2, 2), nn.Linear(2, 2)
    nn.Linear.probe_gain = 2.0  # type: ignore[attr-defined]
    nn.Linear.probe_gains = [2.0]  # type: ignore[attr-defined]
    nn.Linear.probe_knob = _Euler()  # type: ignore[attr-defined]
    steps = {
        "self of a subclass": (lambda x: net(x), lambda: setattr(nn.Linear, "probe_gain", 3.0)),
        "an instance": (lambda x: lin(x) * lin.probe_gain,
                        lambda: setattr(nn.Linear, "probe_gain", 3.0)),
        "a list": (lambda x: lin(x) * sum(lin.probe_gains),
                   lambda: nn.Linear.probe_gains.append(1.0)),
        "an object": (lambda x: lin(x) * lin.probe_knob.k,
                      lambda: setattr(nn.Linear.probe_knob, "k", 0.25)),
    }  # fmt: skip
    step, change = steps[how]
    try:
        like_eager_then_retraced(ptj.jit(step), step, change, x=torch.linspace(0.5, 1.5, 2))
    finally:
        del nn.Linear.probe_gain, nn.Linear.probe_gains  # type: ignore[attr-defined]
        del nn.Linear.probe_knob  # type: ignore[attr-defined]


@pytest.mark.parametrize("where", ["a module", "a dict on a module", "a class"])
def test_an_iterator_kept_on_a_librarys_module_or_class_runs_eagerly(where: str) -> None:
    """``json.STREAM = itertools.cycle(...)``, ``torch.CFG = {"it": ...}``,
    ``nn.Linear.NOISE``: ``next()`` of it at every call, baked by every engine (probe 44b);
    now it runs eagerly, warned, as an iterator held anywhere else does."""
    json.probe_stream = itertools.cycle([1.0, 2.0, 3.0])  # type: ignore[attr-defined]
    torch.probe_cfg = {"it": itertools.cycle([1.0, 2.0, 3.0])}  # type: ignore[attr-defined]
    nn.Linear.probe_noise = itertools.cycle([1.0, 2.0, 3.0])  # type: ignore[attr-defined]
    steps = {
        "a module": lambda x: x * next(json.probe_stream),  # type: ignore[attr-defined]
        "a dict on a module": lambda x: x * next(torch.probe_cfg["it"]),  # type: ignore[attr-defined]
        "a class": lambda x: x * next(nn.Linear.probe_noise),  # type: ignore[attr-defined]
    }
    jitted = ptj.jit(steps[where])
    try:
        with pytest.warns(ptj.JitWarning, match="iterator"):
            got = [jitted(torch.ones(1)).item() for _ in range(5)]
        assert got == [1.0, 2.0, 3.0, 1.0, 2.0]
    finally:
        del json.probe_stream, torch.probe_cfg, nn.Linear.probe_noise  # type: ignore[attr-defined]


# What a library's method reads of its own object (probe round 27): a library's objects are
# guarded by identity, so ``sched.get_last_lr()`` baked the learning rate of the first call
_NET = torch.nn.Linear(3, 3)


def _scheduled(step_size: int = 1) -> tuple[torch.optim.Optimizer, Any]:
    optimizer = torch.optim.SGD(_NET.parameters(), lr=0.1)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size, gamma=0.5)


def _lr_of(scheduler: Any) -> float:
    return float(scheduler.get_last_lr()[0])


class _ScaledBy(torch.nn.Module):
    def __init__(self, scheduler: Any) -> None:
        super().__init__()
        self.scheduler = scheduler

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scheduler.get_last_lr()[0]


def _library_method_cases() -> dict[str, tuple[Callable[..., Any], Callable[[], None]]]:
    """Each: (step, change), reaching a scheduler (or a logger, an event) another way."""
    cases: dict[str, tuple[Callable[..., Any], Callable[[], None]]] = {}

    def stepped(scheduler: Any) -> Callable[[], None]:
        return lambda: (scheduler.optimizer.step(), scheduler.step())

    _, direct = _scheduled()
    cases["called on a global"] = (lambda x: x * direct.get_last_lr()[0], stepped(direct))
    _, passed = _scheduled()
    cases["called by a helper on its parameter"] = (lambda x: x * _lr_of(passed), stepped(passed))
    _, bound = _scheduled()
    held = bound.get_last_lr
    cases["held as a bound method"] = (lambda x: x * held()[0], stepped(bound))
    _, partial_of = _scheduled()
    scaled = functools.partial(lambda s, x: x * _lr_of(s), partial_of)
    cases["bound by a partial"] = (lambda x: scaled(x), stepped(partial_of))
    _, listed = _scheduled()
    schedulers = [listed]

    def looped(x: torch.Tensor) -> torch.Tensor:
        for scheduler in schedulers:
            x = x * scheduler.get_last_lr()[0]
        return x

    cases["in a list looped over"] = (looped, stepped(listed))
    _, attribute = _scheduled()
    cases["an attribute of your module"] = (_ScaledBy(attribute), stepped(attribute))
    logger = __import__("logging").getLogger("phi_torch_jit.tests.library_methods")
    logger.setLevel(10)
    cases["a logger's getEffectiveLevel()"] = (
        lambda x: x * 2 if logger.getEffectiveLevel() <= 10 else x * 3,
        lambda: logger.setLevel(30),
    )
    event = __import__("threading").Event()
    cases["an event's is_set() in a helper"] = (lambda x: _if_set(event, x), event.set)
    waiting = __import__("queue").Queue()
    waiting.put(1)
    cases["a queue's qsize()"] = (lambda x: x * waiting.qsize(), lambda: waiting.put(2))
    normal = torch.distributions.Normal(0.0, 1.0)
    normal.probe_k = 2.0  # type: ignore[attr-defined]
    cases["a number of yours on a library object, read by a helper"] = (
        lambda x: _times_k(normal, x),
        lambda: setattr(normal, "probe_k", 5.0),
    )
    _, as_dict = _scheduled()
    cases["a scheduler's state_dict() (self.__dict__ in a comprehension)"] = (
        lambda x: x * as_dict.state_dict()["_last_lr"][0],
        stepped(as_dict),
    )
    _, by_vars = _scheduled()
    cases["vars(scheduler)"] = (lambda x: x * vars(by_vars)["_last_lr"][0], stepped(by_vars))
    _, closed = _scheduled()
    cases["self in a comprehension's cell (_get_closed_form_lr)"] = (
        lambda x: x * closed._get_closed_form_lr()[0],
        stepped(closed),
    )
    parent = __import__("logging").getLogger("phi_torch_jit.tests.parent")
    child = __import__("logging").getLogger("phi_torch_jit.tests.parent.child")
    parent.setLevel(10)
    cases["a logger's level inherited from its parent"] = (
        lambda x: x * child.getEffectiveLevel(),
        lambda: parent.setLevel(11),
    )
    subset = torch.utils.data.Subset([1.0, 2.0, 3.0], [0, 1])
    cases["len() of a dataset's subset"] = (
        lambda x: x * len(subset),
        lambda: subset.indices.append(2),
    )
    batches = torch.utils.data.BatchSampler(range(10), batch_size=3, drop_last=False)
    cases["len() of a batch sampler"] = (
        lambda x: x * len(batches),
        lambda: setattr(batches, "batch_size", 5),
    )
    template = __import__("string").Template("$a-$b")
    cases["a string template (self in a closure)"] = (
        lambda x: x * len(template.substitute(a="1", b="2")),
        lambda: setattr(template, "template", "$a--------$b"),
    )
    fraction = __import__("fractions").Fraction(1, 2)
    cases["float() of a library's number (its slots, read through a property)"] = (
        lambda x: x * float(fraction),
        lambda: setattr(fraction, "_numerator", 3),
    )
    compared = __import__("fractions").Fraction(1, 2)
    cases["a comparison with a library's number"] = (
        lambda x: x * 2 if compared > 1 else x * 3,
        lambda: setattr(compared, "_numerator", 3),
    )
    cases.update(_distribution_cases())
    return cases


def _distribution_cases() -> dict[str, tuple[Any, Any]]:
    """A distribution whose method reads a list of the library's (callable) objects, each read
    by that method's code in turn (probe 43b): a float changed, a transform added. NumPy's
    polynomials' coefficients: what a property reads, an array by content (probe 43a)."""
    from torch.distributions import Normal, TransformedDistribution
    from torch.distributions.transforms import AffineTransform

    def prior(scale: Any) -> TransformedDistribution:
        return TransformedDistribution(Normal(torch.zeros(3), torch.ones(3)),
                                       [AffineTransform(0.0, scale)])  # fmt: skip

    scaled, grown = prior(2.0), prior(2.0)
    poly, series = np.poly1d([1.0, 2.0]), np.polynomial.Polynomial([1.0, 2.0])
    return {
        "a NumPy poly1d's coefficients (a property reading an array)": (
            lambda x: x * float(np.polyval(poly.coeffs, 2.0)),
            lambda: poly.coeffs.__setitem__(0, 5.0),
        ),
        "a NumPy Polynomial's coefficients": (
            lambda x: x * float(np.polynomial.polynomial.polyval(2.0, series.coef)),
            lambda: series.coef.__setitem__(0, 5.0),
        ),
        "a transform's scale in a distribution": (
            lambda x: scaled.log_prob(x),
            lambda: setattr(scaled.transforms[0], "scale", 3.0),
        ),
        "a transform added to a distribution": (
            lambda x: grown.log_prob(x),
            lambda: grown.transforms.append(AffineTransform(1.0, 1.0)),
        ),
    }


def _if_set(event: Any, x: torch.Tensor) -> torch.Tensor:
    return x * 2 if event.is_set() else x * 3


def _times_k(holder: Any, x: torch.Tensor) -> torch.Tensor:
    return x * holder.probe_k


@pytest.mark.parametrize("case", list(_library_method_cases()))
def test_what_a_library_method_reads_of_its_object_is_guarded(case: str) -> None:
    """The plain values a library object's method reads from ``self`` (``_last_lr`` of
    ``get_last_lr()``, a logger's level, an event's flag), for every library object the step
    reads and every method its code spells, and for a bound method held: a scheduler's step
    between calls retraces, however the step reaches the scheduler."""
    step, change = _library_method_cases()[case]
    like_eager_then_retraced(ptj.jit(step), step, change)


def test_a_tensor_a_library_objects_method_reads_is_an_input_of_the_program() -> None:
    """A transform's ``scale`` tensor changed in place (probe 43b): read by the method's code
    through the distribution's list of transforms, it is an input, no retrace."""
    from torch.distributions import Normal, TransformedDistribution
    from torch.distributions.transforms import AffineTransform

    scale = torch.full((3,), 2.0)
    prior = TransformedDistribution(Normal(torch.zeros(3), torch.ones(3)),
                                    [AffineTransform(torch.zeros(3), scale)])  # fmt: skip
    step = lambda x: prior.log_prob(x)  # noqa: E731
    jitted = ptj.jit(step)
    like_eager_then_retraced(jitted, step, lambda: scale.mul_(1.5), traces=1)
    assert "transforms[0].scale" in jitted.explain() and "input of the program" in jitted.explain()


def test_a_library_objects_state_its_methods_do_not_read_is_not_guarded() -> None:
    """``scheduler.step()`` changes ``last_epoch`` and ``_step_count`` on every call;
    ``get_last_lr()`` reads only ``_last_lr``: a scheduler whose rate holds retraces never."""
    optimizer, scheduler = _scheduled(step_size=100)

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * _lr_of(scheduler)

    jitted = ptj.jit(step)
    x = torch.linspace(0.5, 1.5, 3)
    for _ in range(6):
        torch.testing.assert_close(jitted(x), step(x))
        optimizer.step()
        scheduler.step()
    assert jitted.num_traces == 1, jitted.explain()
    assert "_last_lr" in jitted.explain()


def _k_of(module: Any, x: torch.Tensor) -> torch.Tensor:
    return x * module.probe_cfg["k"]


def _by_torch_passed_to_a_helper(x: torch.Tensor) -> torch.Tensor:
    return _k_of(torch, x)


def test_data_of_yours_on_a_library_module_passed_to_a_helper_is_guarded() -> None:
    """``helper(torch)`` reading ``mod.probe_cfg["k"]``: the path starts at the helper's
    parameter, so no chain from the global ``torch`` spelled it and it was baked (guarded.md's
    honest list until probe round 27). A library's module the walked code reads as a global
    has every name that code spells looked up on it, as a module held in the user's state."""
    torch.probe_cfg = {"k": 2.0}  # type: ignore[attr-defined]
    try:
        step = _by_torch_passed_to_a_helper
        change = lambda: torch.probe_cfg.__setitem__("k", 5.0)  # type: ignore[attr-defined]  # noqa: E731
        like_eager_then_retraced(ptj.jit(step), step, change)
    finally:
        del torch.probe_cfg  # type: ignore[attr-defined]


_HELD_DEEPER = {
    "a parameter's attribute": lambda lin, opt: lambda x: lin(x) * lin.weight.probe_fn(x),
    "a buffer's attribute": lambda bn, opt: lambda x: x * bn.running_mean.probe_fn(x),
    "an optimizer's param group": lambda lin, opt: lambda x: x * opt.param_groups[0]["probe_fn"](x),
}


@pytest.mark.parametrize("where", list(_HELD_DEEPER))
def test_code_of_yours_held_by_a_librarys_tensors_and_containers_is_walked(where: str) -> None:
    """A function of yours set on a module's parameter or buffer (``lin.weight.sched``), or
    kept in a dict in a list of a library's object (``opt.param_groups[0]["gain"]``): only its
    identity was guarded, not what its code reads, on every engine (probe 46b); a bound
    method, a partial or an object there was walked. Now its code is walked too."""
    torch.manual_seed(0)
    module = nn.BatchNorm1d(3) if where == "a buffer's attribute" else nn.Linear(3, 3)
    holder = module.running_mean if where == "a buffer's attribute" else module.weight
    holder.probe_fn = _scaled  # type: ignore[union-attr]
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    opt.param_groups[0]["probe_fn"] = _scaled
    step = _HELD_DEEPER[where](module, opt)
    try:
        like_eager_then_retraced(ptj.jit(step), step, lambda: _K.__setitem__(0, 3.0))
    finally:
        _K[0] = 1.0
