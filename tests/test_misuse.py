"""The misuse catalog (docs/troubleshooting.md): each entry triggered, message matched."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import Counter

import phi_torch_jit as ptj

pytestmark = pytest.mark.all_engines


def test_print_in_jitted_function_warns_once_and_does_not_repeat(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def noisy(x: torch.Tensor) -> torch.Tensor:
        print("step!")
        return x + 1

    step = ptj.jit(noisy)
    with pytest.warns(ptj.JitWarning, match=r"side effects \(print at .*test_misuse.py:\d+\)"):
        step(torch.ones(1))
    assert capsys.readouterr().out.count("step!") == 1  # once per compile: the record pass
    step(torch.ones(1))
    assert capsys.readouterr().out.count("step!") == 0  # compiled calls run no Python
    step(torch.ones(2))  # a retrace prints again but does not warn again
    assert capsys.readouterr().out.count("step!") == 1  # JAX's rule, on every engine


def test_output_structure_changing_between_passes_runs_eagerly_with_one_warning() -> None:
    """NOTE [eager, never a crash]: the record pass ran; the trace disagreeing is ours."""
    runs = Counter()

    def unstable(x: torch.Tensor) -> Any:
        runs.forward += 1
        return (x, x) if runs.forward == 1 else x

    jitted = ptj.jit(unstable, side_effects="trace")  # counts its passes
    with pytest.warns(ptj.JitWarning, match="different structure while tracing") as warned:
        first = jitted(torch.ones(1))
        later = jitted(torch.ones(1))
    assert len(warned) == 1
    assert isinstance(first, tuple) and torch.equal(later, torch.ones(1))  # eager's results


def test_jit_of_a_non_callable() -> None:
    with pytest.raises(TypeError, match="jit needs a callable, got int"):
        ptj.jit(3)  # type: ignore[call-overload]


def test_returning_inputs_and_views_of_inputs_is_supported() -> None:
    step = ptj.jit(lambda x: (x, x[1:], x.view(2, 2)))
    x = torch.arange(4.0)
    step(x)
    same, tail, square = step(x)
    assert same is x or torch.equal(same, x)
    x.add_(1)  # views alias the input as in eager
    assert torch.equal(tail, x[1:]) and torch.equal(square, x.view(2, 2))


INTERPRETER_ERRORS = [
    (
        "The following operation failed in the TorchScript interpreter.\n"
        "Traceback of TorchScript (most recent call last):\n"
        '  File "lib.py", line 5, in f\n'
        "def f(x: torch.Tensor) -> torch.Tensor:\n"
        "    return x.view(3, 5)\n"
        "           ~~~~~~ <--- HERE\n"
        "RuntimeError: shape '[3, 5]' is invalid for input of size 4\n",
        "RuntimeError: shape '[3, 5]' is invalid for input of size 4 "
        '[File "lib.py", line 5, in f: return x.view(3, 5)]',
    ),
    (
        "The following operation failed in the TorchScript interpreter.\n"
        "Traceback of TorchScript (most recent call last):\n"
        '  File "lib.py", line 9, in g\n'
        "    if x.sum() > 0:\n"
        "        raise RuntimeError()\n"
        "        ~~~~~~~~~~~~~~~~~~ <--- HERE\n"
        "    return x\n"
        "builtins.RuntimeError: \n",
        "RuntimeError: builtins.RuntimeError raised without a message "
        '[File "lib.py", line 9, in g: raise RuntimeError()]',
    ),
]


@pytest.mark.parametrize(("message", "described"), INTERPRETER_ERRORS)
def test_a_torchscript_interpreter_error_is_described_by_what_failed_and_where(
    message: str, described: str
) -> None:
    """The interpreter's message used to be cut to its last line: "RuntimeError: RuntimeError:"
    for a scripted library function that raised without a message (issue 35)."""
    from phi_torch_jit.errors import describe_error

    assert describe_error(RuntimeError(message)) == described
