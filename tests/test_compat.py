"""The private torch APIs in one place (_compat) and torch's TorchScript notices."""

from __future__ import annotations

import io
import pickle
import re
import tokenize
import warnings
from pathlib import Path

import pytest
import torch

import phi_torch_jit as ptj
from phi_torch_jit import _compat
from phi_torch_jit._compat import PRIVATE_APIS, PrivateAPI, missing_private_apis
from phi_torch_jit._warnings import TORCHSCRIPT_NOTICE

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "phi_torch_jit"


def test_every_private_api_exists_on_this_torch() -> None:
    missing = missing_private_apis()
    assert not missing, f"torch {torch.__version__} lacks:\n" + "\n".join(missing)


def test_each_entry_says_why_and_who_uses_it() -> None:
    for api in PRIVATE_APIS:
        assert api.names and all(n.startswith("torch.") for n in api.names)
        assert len(api.why) > 20 and api.used_by


def test_a_missing_api_raises_a_clear_error_naming_it() -> None:
    gone = PrivateAPI(
        ("torch._no_such_module.thing", "torch._C._no_such_function"), "a reason", "x"
    )
    with pytest.raises(ptj.JitError, match=r"torch\._no_such_module\.thing.*a reason") as info:
        gone.find()
    assert isinstance(info.value, RuntimeError)
    assert torch.__version__ in str(info.value) and "pip install torch==" in str(info.value)


def test_later_names_are_tried_when_the_first_is_gone() -> None:
    api = PrivateAPI(("torch._C._no_such_function", "torch._C._get_tracing_state"), "why", "x")
    assert api.find() is torch._C._get_tracing_state


def test_private_torch_names_appear_only_in_the_compat_module() -> None:
    """A private torch name used elsewhere is one more place to look when torch changes.

    Code tokens only: names in strings and comments (docstrings, messages) are not uses.
    """
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if PACKAGE / "_compat" in path.parents:  # the compat package
            continue
        for line, dotted in _dotted_names(path.read_text()):
            if _private_torch(dotted):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {dotted}")
    assert not offenders, "\n".join(offenders)


def _private_torch(dotted: str) -> bool:
    parts = dotted.split(".")
    dunder = lambda p: p.startswith("__") and p.endswith("__")  # noqa: E731 -- Python's own
    return parts[0] == "torch" and any(p.startswith("_") and not dunder(p) for p in parts)


def _dotted_names(source: str) -> list[tuple[int, str]]:
    """(line, ``a.b.c``) for every dotted name among the code tokens (strings, comments out)."""
    found: list[tuple[int, str]] = []
    parts: list[str] = []
    line = 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME and (not parts or parts[-1] == "."):
            parts.append(token.string)
            line = line or token.start[0]
        elif token.string == "." and parts and parts[-1] != ".":
            parts.append(".")
        else:
            if parts:
                found.append((line, "".join(parts).rstrip(".")))
            parts, line = [], 0
            if token.type == tokenize.NAME:
                parts, line = [token.string], token.start[0]
    return found


def test_the_source_scan_sees_code_not_text() -> None:
    code = 'x = torch._C._foo("torch._in_a_string")  # torch._in_a_comment\n'
    assert [n for _, n in _dotted_names(code) if _private_torch(n)] == ["torch._C._foo"]
    imported = [n for _, n in _dotted_names("from torch._dynamo.utils import counters\n")]
    assert any(_private_torch(n) for n in imported)
    assert not _private_torch("torch.__version__") and not _private_torch("torch.nn.Linear")
    assert _private_torch("torch.Tensor._version")


def test_original_apply_binds_classmethods_of_both_kinds() -> None:
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            return 2 * x

        @staticmethod
        def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
            return 2 * g

    native = torch.autograd.Function.__dict__["apply"]  # C-level on torch 2.15
    python = classmethod(lambda cls, x: cls.forward(None, x) + 1)  # a Python classmethod
    x = torch.ones(2)
    assert torch.equal(_compat.original_function_apply(native)(Double, x), 2 * x)
    assert torch.equal(_compat.original_function_apply(python)(Double, x), 2 * x + 1)


def test_tested_versions_match_the_pinned_files_and_the_declared_range() -> None:
    tomllib = pytest.importorskip("tomllib")
    pinned = {}
    for path in (ROOT / "requirements").glob("torch-*.txt"):
        lines = [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]
        assert lines == [f"torch=={path.stem.removeprefix('torch-')}"], path
        pinned[path.stem.removeprefix("torch-")] = path
    as_tuple = lambda v: tuple(int(p) for p in v.split("."))  # noqa: E731
    assert tuple(sorted(pinned, key=as_tuple)) == _compat.TESTED_TORCH
    makefile = (ROOT / "Makefile").read_text()
    assert "requirements/torch-%.txt" in makefile and "tools/install_torch.sh" in makefile
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (spec,) = [d for d in project["dependencies"] if d.startswith("torch")]
    low = re.search(r">=([\d.]+)", spec)
    high = re.search(r"<([\d.]+)", spec)
    assert low and high
    assert (
        as_tuple(low.group(1)) == as_tuple(_compat.TESTED_TORCH[0])[: len(low.group(1).split("."))]
    )
    for version in _compat.TESTED_TORCH:
        assert as_tuple(low.group(1)) <= as_tuple(version) < as_tuple(high.group(1))


def _scripting_step(x: torch.Tensor) -> torch.Tensor:
    """Like PhiML's torch backend: scripts a helper inside the function, on every call."""

    @torch.jit.script
    def double(t: torch.Tensor) -> torch.Tensor:
        return 2 * t

    return double(x) + 1


def _notices(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if re.match(TORCHSCRIPT_NOTICE, str(w.message))]


@pytest.mark.all_engines
@pytest.mark.torchscript_bodies
@pytest.mark.uses_torchscript  # the user's function scripts a helper
def test_torchscript_notices_do_not_reach_users_of_jitted_functions() -> None:
    step = ptj.jit(_scripting_step)
    x = torch.randn(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert torch.equal(step(x), 2 * x + 1)
    assert not _notices(caught)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


@pytest.mark.uses_torchscript  # the user's function scripts a helper
def test_notices_are_hidden_only_while_a_pass_runs() -> None:
    """Outside jit the user's own TorchScript calls warn as torch decides."""
    ptj.jit(_scripting_step)(torch.randn(3))
    assert not [
        f for f in warnings.filters if f[1] is not None and f[1].pattern == TORCHSCRIPT_NOTICE
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.jit.script(_identity)
    assert _notices(caught), "torch.jit.script no longer warns: update docs/engines.md"


def test_inductor_decompositions_on_the_cpu_keep_only_grid_sampler_as_aten() -> None:
    from torch._inductor import config as inductor_config
    from torch._inductor.decomposition import select_decomp_table

    from phi_torch_jit._compat._inductor import _kept_on_cpu

    ours = _compat._decompositions({"fallback_random": True})
    with inductor_config.patch(fallback_random=True):
        theirs = select_decomp_table()
    dropped = {str(op) for op in theirs if op not in ours}
    if _kept_on_cpu():
        assert dropped and all(name.startswith("aten.grid_sampler_2d.") for name in dropped)
    else:  # torch 2.11: inductor cannot fall back to an op its global table decomposes
        assert not dropped and torch.__version__ < "2.13"
    assert set(ours) <= set(theirs)
    # Inductor's cache keys pickle the table: some entries are C++ functions, which cannot be
    # pickled (every compile bypassed the on-disk caches); ours pickles as the call making it.
    again = pickle.loads(pickle.dumps(ours))
    assert again == ours and pickle.dumps(again) == pickle.dumps(ours)
