"""Stage 4: the module guard notices every state change a trace baked in, and nothing else."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from torch import nn

import phi_torch_jit as ptj
from phi_torch_jit._guards import ModuleGuard, has_backward_hooks
from phi_torch_jit._phases import MODULE_HOOK


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5), nn.Sequential(nn.Tanh()))


def test_training_flag_change_is_noticed_and_described() -> None:
    net = _net()
    guard = ModuleGuard([net])
    assert guard.holds()
    net[1].eval()
    assert not guard.holds()
    assert guard.describe_change() == "module Sequential.1 training True -> False"
    net[1].train()
    assert guard.holds()


def test_hooks_added_removed_and_replaced_are_noticed() -> None:
    net = _net()
    first = net[2][0].register_forward_hook(lambda m, a, o: o)
    guard = ModuleGuard([net])
    second = net[0].register_forward_pre_hook(lambda m, a: None)
    assert (
        not guard.holds() and "forward_pre_hooks of module Sequential.0" in guard.describe_change()
    )
    second.remove()
    assert guard.holds()
    first.remove()  # removal only
    assert not guard.holds()
    net[2][0].register_forward_hook(lambda m, a, o: o)  # "replaced": same count, new hook
    assert not guard.holds() and "forward_hooks of module Sequential.2.0" in guard.describe_change()


def test_global_hooks_are_guarded() -> None:
    guard = ModuleGuard([_net()])
    handle = nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    try:
        assert not guard.holds()
        assert guard.describe_change() == "forward_hooks of module global changed"
    finally:
        handle.remove()
    assert guard.holds()


def test_replaced_parameters_are_noticed_in_place_updates_are_not() -> None:
    net = _net()
    guard = ModuleGuard([net])
    with torch.no_grad():
        net[0].weight.mul_(2)
    net.load_state_dict(net.state_dict())
    assert guard.holds()
    net.load_state_dict(net.state_dict(), assign=True)
    assert not guard.holds()
    assert "replaced by new tensors" in guard.describe_change()


def test_unrelated_hooks_and_our_record_hook_do_not_trip_the_guard() -> None:
    net = _net()
    guard = ModuleGuard([net])
    other = nn.Linear(1, 1)
    other.register_forward_hook(lambda m, a, o: o)  # advances torch's handle counter
    x = torch.ones(1, requires_grad=True)
    x.register_hook(lambda g: g)
    assert guard.holds()
    with MODULE_HOOK.active():  # another thread recording installs our global pre-hook
        assert guard.holds()
    assert guard.holds()


def test_training_only_guard_ignores_hooks() -> None:
    net = _net()
    guard = ModuleGuard([net], hooks=False)
    net[0].register_forward_hook(lambda m, a, o: o)
    assert guard.holds()
    net.eval()
    assert (
        not guard.holds() and guard.describe_change() == "module Sequential training True -> False"
    )


def test_has_backward_hooks() -> None:
    net = _net()
    assert not has_backward_hooks(net.modules())
    handle = net[0].register_full_backward_hook(lambda m, gi, go: None)
    assert has_backward_hooks(net.modules())
    handle.remove()
    handle = net[0].register_full_backward_pre_hook(lambda m, go: None)
    assert has_backward_hooks(net.modules())


class _Optional(nn.Module):
    """Reads what may be registered later: a buffer, a parameter, a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        out = self.lin(t)
        offset = getattr(self, "offset", None)  # a buffer, if registered
        if offset is not None:
            out = out + offset
        if "gain" in self._parameters:
            out = out * self._parameters["gain"]
        extra = getattr(self, "extra", None)  # a submodule, if added
        return extra(out) if extra is not None else out


def test_a_buffer_parameter_or_submodule_registered_later_is_noticed_and_described() -> None:
    """Registered after the trace and read with a default: the traced program took the other
    branch (found by a probe: ``register_buffer`` later stayed unseen)."""
    module = _Optional()
    guard = ModuleGuard([module])
    assert guard.holds()
    module.register_buffer("offset", torch.ones(3), persistent=False)
    assert not guard.holds()
    assert guard.describe_change() == "module _Optional holds 1 buffers, 0 when traced"
    guard = ModuleGuard([module])
    module.register_parameter("gain", nn.Parameter(torch.full((3,), 2.0)))
    assert not guard.holds() and "1 parameters, 0 when traced" in guard.describe_change()
    guard = ModuleGuard([module])
    module.add_module("extra", nn.Tanh())
    assert not guard.holds() and "2 submodules, 1 when traced" in guard.describe_change()
    guard = ModuleGuard([module])
    del module.offset  # removed again
    assert not guard.holds() and "0 buffers, 1 when traced" in guard.describe_change()


def test_registrations_after_the_trace_retrace_and_match_eager() -> None:
    import phi_torch_jit as ptj

    module = _Optional()
    jitted = ptj.jit(module)
    x = torch.randn(2, 3)
    changes = [
        lambda: module.register_buffer("offset", torch.full((3,), 2.0), persistent=False),
        lambda: module.register_parameter("gain", nn.Parameter(torch.full((3,), -1.0))),
        lambda: module.add_module("extra", nn.Tanh()),
    ]
    with torch.no_grad():
        for change in [lambda: None, *changes]:
            change()
            for _ in range(2):
                torch.testing.assert_close(jitted(x), module(x))
    assert jitted.num_traces == 4


class _Act(nn.Module):
    SCALE = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * type(self).SCALE


class _Tripled(_Act):
    SCALE = 3.0


class _Sigmoid(_Act):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x)


def test_a_module_given_another_class_is_noticed_and_described() -> None:
    """``module.__class__ = Other`` keeps every dict the other checks read (found by a
    probe: the program kept the old class's forward and constants)."""
    net = nn.Sequential(nn.Linear(2, 2), _Act())
    guard = ModuleGuard([net])
    net[1].__class__ = _Tripled
    assert not guard.holds()
    assert guard.describe_change() == "module Sequential.1 is of class _Tripled, _Act when traced"
    net[1].__class__ = _Act
    assert guard.holds()


def test_a_deletion_that_rebuilds_the_submodule_dict_is_noticed() -> None:
    """``del net[i]`` on a Sequential or ModuleList builds a new ``_modules`` dict; a guard
    that kept the old one saw the modules traced with forever (found by a probe)."""
    net = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))
    net.append(nn.Sigmoid())
    guard = ModuleGuard([net])
    del net[3]
    assert not guard.holds()
    assert guard.describe_change() == (
        "module Sequential holds its submodules in a new dict (del net[i]?)"
    )


def test_class_swaps_and_rebuilt_submodule_dicts_retrace_and_match_eager() -> None:
    import phi_torch_jit as ptj

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), _Act(), nn.Linear(4, 4))
    step = ptj.jit(lambda x: net(x).pow(2).sum())
    x = torch.randn(3, 4)

    def replace_first() -> None:
        net[0] = nn.Linear(4, 4)

    def scale_first() -> None:
        with torch.no_grad():
            net[0].weight.mul_(2)

    changes = [
        lambda: setattr(net[1], "__class__", _Tripled),
        lambda: setattr(net[1], "__class__", _Sigmoid),
        lambda: net.append(nn.Sigmoid()),
        lambda: net.__delitem__(3),
        replace_first,
        scale_first,
    ]
    with torch.no_grad():
        for change in [lambda: None, *changes]:
            change()
            for _ in range(2):
                torch.testing.assert_close(step(x), net(x).pow(2).sum())


class _Named(nn.Module):
    """Applies the children and buffers whose names do not start with ``off_``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Tanh()
        self.parts = nn.ModuleDict({"scale": nn.Identity()})
        self.register_buffer("shift", torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name, child in self.named_children():
            if not name.startswith("off_") and name != "parts":
                x = child(x)
        x = x * (2.0 if "scale" in self.parts else 1.0)
        for name, buffer in self.named_buffers():
            x = x if name.startswith("off_") else x + buffer
        return x


def _rename_child(m: _Named) -> None:
    m.off_b = m.b
    del m.b


def _rename_key(m: _Named) -> None:
    m.parts["off_scale"] = m.parts.pop("scale")


def _rename_buffer(m: _Named) -> None:
    m.register_buffer("off_shift", m.shift)
    del m.shift


def test_a_child_key_or_buffer_renamed_is_noticed_and_described() -> None:
    """The same objects under other names, as many as before (probe round 23: a loop over
    ``named_children()`` or ``named_buffers()`` branching on names took the traced path)."""
    for rename, said in (
        (_rename_child, "submodule _Named.b (Tanh) renamed or removed"),
        (_rename_key, "submodule _Named.parts.scale (Identity) renamed or removed"),
        (_rename_buffer, "parameters or buffers were renamed"),
    ):
        module = _Named()
        guard = ModuleGuard([module])
        assert guard.holds()
        rename(module)
        assert not guard.holds()
        assert guard.describe_change().startswith(said), guard.describe_change()


def test_renamed_children_keys_and_buffers_retrace_and_match_eager() -> None:
    import phi_torch_jit as ptj

    for rename in (_rename_child, _rename_key, _rename_buffer):
        module = _Named()
        jitted = ptj.jit(module)
        x = torch.randn(2, 3)
        with torch.no_grad():
            for change in (lambda m: None, rename):
                change(module)
                for _ in range(2):
                    torch.testing.assert_close(jitted(x), module(x))
        assert jitted.num_traces == 2, jitted.explain()


class _Filled(nn.Module):
    def __init__(self, fill: object) -> None:
        super().__init__()
        self.fill = fill

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.full((4,), self.fill)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("traced", "later"),
    [(2, 2.0), (0.0, -0.0), (True, 1), ((1, 2), (1.0, 2)), (frozenset({1, 9}), frozenset({9, 1}))],
    ids=["int-float", "zero-sign", "bool-int", "tuple-types", "frozenset-order"],
)
def test_an_attribute_changed_to_an_equal_value_of_another_type_or_sign_is_a_change(
    traced: object, later: object
) -> None:
    """Probe round 35: the module guard compared plain attributes with ``==``, so ``2`` ->
    ``2.0`` kept an int64 program where eager code computes in float32, ``0.0`` -> ``-0.0``
    the wrong signs. An equal value in a new object holds, and is then compared by identity."""
    module = _Filled(traced)
    guard = ModuleGuard([module])
    module.fill = pickle.loads(pickle.dumps(traced))  # equal (a new object where not cached)
    assert guard.holds()
    module.fill = later
    assert not guard.holds() and "attribute _Filled.fill" in guard.describe_change()


class _Scaled(nn.Module):
    def __init__(self, scale: object) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale  # type: ignore[operator]


def test_a_number_attribute_replaced_by_a_tensor_retraces_not_crashes() -> None:
    """``m.scale = torch.ones(4)`` in place of a number raised "Boolean value of Tensor ... is
    ambiguous" in the guard; a 0-dim tensor compared equal and its gradient was lost."""
    module = _Scaled(5.0)
    step = ptj.jit(lambda x: module(x))
    x = torch.arange(4.0)
    for _ in range(2):
        torch.testing.assert_close(step(x), x * 5.0)
    module.scale = torch.full((4,), 3.0)
    torch.testing.assert_close(step(x), x * 3.0)
    scale = torch.tensor(5.0, requires_grad=True)
    module.scale = scale
    step(x).sum().backward()
    assert scale.grad is not None and float(scale.grad) == float(x.sum())
    assert step.num_traces == 3


def _set_state(module: nn.Module, other: nn.Module) -> None:
    module.__setstate__(dict(other.__dict__))


def _update_dict(module: nn.Module, other: nn.Module) -> None:
    module.__dict__.update(other.__dict__)


@pytest.mark.parametrize("swap", [_set_state, _update_dict])
def test_a_modules_dict_updated_from_another_module_is_noticed_and_described(swap: object) -> None:
    """Another module's weights swapped in through its ``__dict__`` (probe 36b): the
    registries are other dicts, of as many tensors, under the same names; the guard held the
    traced ones and compiled calls kept the old weights."""
    torch.manual_seed(3)
    first, other = nn.Linear(3, 3), nn.Linear(3, 3)
    guard = ModuleGuard([first])
    assert guard.holds()
    swap(first, other)  # type: ignore[operator]
    assert not guard.holds()
    said = guard.describe_change()
    assert said.startswith("module Linear holds another parameters dict"), said
    assert guard.changed_attributes() == []  # not a counter the step might leave unread

    module = nn.Linear(3, 3)
    jitted, x = ptj.jit(lambda x: module(x)), torch.randn(2, 3)
    for change in (lambda: None, lambda: swap(module, nn.Linear(3, 3))):  # type: ignore[operator]
        change()
        for _ in range(3):
            torch.testing.assert_close(jitted(x), module(x))
        jitted.wait_compiled()
        torch.testing.assert_close(jitted(x), module(x))
    assert jitted.num_traces == 2, jitted.explain()


class _LayoutBranch(nn.Module):
    """Branches in Python on its weight's strides and reads its dtype and shape."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1, 2, 2, 1))
        self.register_buffer("b", torch.ones(2, 3))
        self.plain = nn.Parameter(torch.ones(1))  # read by ops only: not checked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 2.0 if self.w.is_contiguous() else 3.0
        shift = float(self.b.stride()[0]) + (10.0 if self.b.dtype == torch.float64 else 0.0)
        return x * scale + shift + self.plain.float()


@pytest.mark.all_engines
def test_a_parameters_layout_read_by_python_is_checked_on_every_call() -> None:
    """Probe 39c: ``module.to(memory_format=torch.channels_last)`` keeps the parameter objects
    and gives them new strides (so does ``p.data = restrided``); the module guard compared
    dtype, device and shape only after a program failed on them, so a branch on
    ``w.is_contiguous()`` or ``w.stride()`` kept the traced path on every engine. Python's
    reads of a parameter's or buffer's layout are noted in the record pass, and the guard
    checks those tensors' layout on every call."""
    module, x = _LayoutBranch(), torch.ones(4)
    jitted = ptj.jit(module)
    changes = [
        lambda: module.to(memory_format=torch.channels_last),
        lambda: setattr(module.b, "data", module.b.data.t().contiguous().t()),
        lambda: module.to(memory_format=torch.contiguous_format),
        lambda: setattr(module.b, "data", module.b.data.double()),
        lambda: setattr(module.b, "data", module.b.data.float().contiguous()),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for change in [lambda: None, *changes]:
            change()
            for _ in range(3):
                torch.testing.assert_close(jitted(x), module(x))
                jitted.wait_compiled()
    assert jitted.num_traces == 5  # the last state is the first: its program serves it
    guard = jitted.specializations[-1].guard
    assert [name for name, *_ in guard.laid_out] == ["_LayoutBranch.w", "_LayoutBranch.b"]
    module.to(memory_format=torch.channels_last)
    assert "_LayoutBranch.w: layout (1, 2, 2, 1) torch.float32 strides" in guard.describe_change()
    assert "layout (shape, dtype, strides) checked on every call: _LayoutBranch.w" in (
        jitted.explain()
    )


@pytest.mark.all_engines
def test_a_python_attribute_set_later_on_a_parameter_retraces() -> None:
    """``lin.weight.gain = 3.0`` after the trace, read as ``getattr(w, "gain", 1.0)``: the
    guard compared the attributes the parameter held, not how many (probe 45b)."""
    torch.manual_seed(0)
    lin = nn.Linear(2, 2)

    def step(x: torch.Tensor) -> torch.Tensor:
        return lin(x) * getattr(lin.weight, "gain", 1.0)

    jitted, x = ptj.jit(step), torch.ones(1, 2)
    with torch.no_grad():
        for change in [lambda: None, lambda: setattr(lin.weight, "gain", 3.0)]:
            change()
            for _ in range(3):
                torch.testing.assert_close(jitted(x), step(x))
                jitted.wait_compiled()
    assert jitted.num_traces == 2
    guard = ModuleGuard([lin])
    del lin.weight.gain
    assert guard.describe_change().startswith("a parameter or buffer gained or lost")


@pytest.mark.all_engines
def test_an_intermediates_strides_read_by_python_check_every_parameters_layout() -> None:
    """Probe 43b: a convolution's output is channels-last where its weight is, so a branch on
    ``y.is_contiguous()`` of that output followed ``conv.to(memory_format=channels_last)``,
    which keeps the parameter objects. Python read no parameter's layout; it read the strides
    of another tensor, and then the guard checks every parameter's and buffer's layout. A
    read of an intermediate's shape alone does not: the parameters' shapes are checked where
    a program fails on them (``moved``)."""
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 2, 3, padding=1)

    def step(x: torch.Tensor) -> torch.Tensor:
        y = conv(x)
        return y * 2.0 if y.is_contiguous() else y * 3.0

    jitted, x = ptj.jit(step), torch.randn(1, 2, 5, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ptj.JitWarning)
        for change in [lambda: None, lambda: conv.to(memory_format=torch.channels_last)]:
            change()
            for _ in range(3):
                torch.testing.assert_close(jitted(x), step(x))
                jitted.wait_compiled()
    assert jitted.num_traces == 2
    assert [n for n, *_ in jitted.specializations[-1].guard.laid_out] == [
        "Conv2d.weight",
        "Conv2d.bias",
    ]
    shaped = ptj.jit(lambda x: conv(x) * conv(x).shape[1])
    shaped(x)
    assert shaped.specializations[-1].guard.laid_out == ()
