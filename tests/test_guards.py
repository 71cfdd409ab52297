"""Stage 4: the module guard notices every state change a trace baked in, and nothing else."""

from __future__ import annotations

import torch
from torch import nn

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
