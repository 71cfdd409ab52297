"""The package's shape: no import cycle, leaves stay leaves, short hot path."""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import phi_torch_jit as ptj

PACKAGE = Path(ptj.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_module(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` names; a relative one resolved in ``package``."""
    if not node.level:
        return node.module or ""
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def _imports(path: Path) -> set[str]:
    """Modules (and ``module.name``s) ``path`` imports anywhere: inside functions and under
    ``if TYPE_CHECKING:`` too."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = _imported_module(node, package)
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    """Each package module -> the package modules it imports."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _imports(path) & set(modules) - {name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (its first node repeated at its end), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_counting_type_hints() -> None:
    """No module imports one that imports it back, at import time, inside a function or only
    for type hints (the frame's fields are typed by protocols in ``_context``, which the
    stages' classes satisfy)."""
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_cycle_finder_sees_cycles() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_lower_floors_do_not_import_higher_ones() -> None:
    graph = _graph()
    leaves = ("errors", "_compat", "_patches", "_sources", "_context", "_reads._records",
              "_reads._canonical")  # fmt: skip
    compat = {m for m in graph if m.startswith("phi_torch_jit._compat.")}
    allowed_by = {
        "_compat": {"phi_torch_jit.errors", *compat},
        "_reads._records": {"phi_torch_jit._reads._canonical"},
    }  # its forms
    for leaf in leaves:
        assert graph[f"phi_torch_jit.{leaf}"] <= allowed_by.get(leaf, set()), leaf
    for module in compat:  # the compat package's modules: errors and each other only
        assert graph[module] <= {"phi_torch_jit.errors", *compat}, module
    for engine in ("engines", "engines.compile", "engines.torchscript", "engines.eager"):
        imported = graph[f"phi_torch_jit.{engine}"]
        assert "phi_torch_jit._context" not in imported, engine  # engines are told, not asking
        assert not any(m.startswith("phi_torch_jit._") and m.rsplit(".", 1)[-1] in
                       ("_jit", "_pipeline", "_trace", "_record", "_custom_op")
                       for m in imported), engine  # fmt: skip


FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("records and services (leaves)",
     ("errors", "extend", "_compat", "_patches", "_sources", "_context", "_reads._records",
      "_reads._canonical", "_libraries", "_warnings")),
    ("stage 0: signature", ("_signature", "_spec_text", "_callable_state", "_ambient")),
    ("the phases' watches (what each phase patches)",
     ("_side_effects", "_param_writes", "_watched_calls", "_unguardable", "_fast_paths",
      "_modules_seen", "_type_tests",
      "_custom", "_function_ctx", "_function_closures", "_function", "_tensor_reads",
      "_static_shapes", "_rnn_layers", "_value_sized", "_value_guards", "_own_backward",
      "_inner_grad", "_state", "_phases", "_registries")),
    ("stage 1: record and guards", ("_reads", "_record")),
    ("stage 2: compile custom functions",
     ("_fast_capture", "_inductor_fixes", "_loops", "engines", "_backward", "_graph_safety",
      "_custom_op")),
    ("stage 3: wrapper", ("_wrapper", "_rebinding")),
    ("stage 4: trace", ("_replay", "_trace")),
    ("stage 5: serve",
     ("_meter", "_attribute_values", "_scripted_modules", "_guards", "_specialization",
      "_path_meter", "_cache", "_explain")),
    ("the driver", ("_options", "_pipeline", "_jit")),
    ("public surface and library adapters", ("", "phiflow", "adapters")),
)  # fmt: skip
"""The package in pipeline order (docs/design.md, "Floors"): a module imports modules of its
own floor or lower ones, never higher. A name covers its subpackage; "" is ``__init__``."""


def _floor(module: str) -> int:
    name = module.removeprefix("phi_torch_jit").removeprefix(".")
    for number, (_, names) in enumerate(FLOORS):
        if any(name == n or (n and name.startswith(n + ".")) for n in names):
            return number
    raise AssertionError(f"{module} is on no floor: add it to FLOORS (and docs/design.md)")


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """The imports of ``graph`` that go to a higher floor."""
    return [
        f"{module} ({FLOORS[_floor(module)][0]}) imports {imported} ({FLOORS[_floor(imported)][0]})"
        for module, imports in sorted(graph.items())
        for imported in sorted(imports)
        if _floor(imported) > _floor(module)
    ]


def test_each_module_imports_only_its_floor_and_lower_ones() -> None:
    """Stage k imports stages before it and the leaf records, never a later stage; so the core
    (every floor below the last) imports no library adapter."""
    graph = _graph()
    upward = _upward(graph)
    assert not upward, "\n".join(upward)
    leaves = {m for m in graph if _floor(m) == 0}
    assert all(graph[m] <= leaves for m in leaves)


def test_the_floor_check_sees_an_upward_import() -> None:
    assert _floor("phi_torch_jit._record") < _floor("phi_torch_jit._custom_op")
    assert _floor("phi_torch_jit.engines.compile") == _floor("phi_torch_jit._loops._block")
    assert _floor("phi_torch_jit.adapters.phiml._bridge") == len(FLOORS) - 1
    record, adapter = "phi_torch_jit._record", "phi_torch_jit.adapters.phiml"
    (found,) = _upward({record: {adapter}, adapter: {record}})
    assert found.startswith(f"{record} (stage 1: record and guards) imports {adapter} (public")
    with pytest.raises(AssertionError, match="on no floor"):
        _floor("phi_torch_jit._somewhere_new")


def test_the_core_names_no_library() -> None:
    """Below the adapters no module imports PhiML or PhiFlow (nor mentions their modules in an
    import inside a function): library knowledge lives in ``adapters``."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        if _floor(module) == len(FLOORS) - 1:
            continue
        for imported in _imports(path):
            if imported.split(".")[0] in ("phiml", "phi"):
                found.append(f"{module}: {imported}")
    assert not found, found


def _modules_crossed(call: Any) -> set[str]:
    """The package's modules whose Python ``call`` runs, as paths without the suffix
    (``_jit``, ``engines/auto``, ``adapters/phiml/__init__``)."""
    crossed: set[str] = set()
    root = str(PACKAGE)

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(root):
            path = Path(frame.f_code.co_filename).relative_to(PACKAGE).with_suffix("")
            crossed.add(path.as_posix())

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return crossed


def test_a_cache_hit_crosses_at_most_seven_modules() -> None:
    """Core modules a cache hit runs Python of (the key's ambient part in ``_ambient``, its own
    module since session 36), beside the engine's own (engine "auto", the
    default: its tiered program and the parameters' requires_grad check; "torchscript": its
    unoptimized call of a differentiable program), and at most one module of a library's
    adapter (PhiML's precision, read for the cache key: ``extend.Library.ambient``)."""
    engine_files = {f"engines/{p.stem}" for p in (PACKAGE / "engines").glob("*.py")}
    adapters = {"adapters/phiml/__init__"}
    net = torch.nn.Linear(4, 4)

    @ptj.jit
    def step(x: torch.Tensor, scale: float = 2.0) -> dict[str, torch.Tensor]:
        return {"y": net(x) * scale}

    x = torch.randn(3, 4)
    step(x)
    step(x)  # engine "auto" (compiling on the caller in tests) switches in its second call
    step(x)  # and its second compiled call queues the loops a backward captured (none here)
    measuring = _modules_crossed(lambda: step(x))  # its first calls are timed: one more
    assert len(measuring - engine_files - adapters) <= 8 and "_meter" in measuring, measuring
    assert len(measuring & engine_files) <= 2, sorted(measuring)
    kept = ptj.jit(step.__wrapped__, fallback="off")  # compiled, whatever the machine measures
    for _ in range(3):
        kept(x)
    crossed = _modules_crossed(lambda: kept(x))
    assert len(crossed - engine_files - adapters) <= 7, sorted(crossed)
    assert len(crossed & engine_files) <= 2, sorted(crossed)
    assert {c for c in crossed if c.startswith("adapters/")} <= adapters, sorted(crossed)
    assert {"_jit", "_signature", "_ambient", "_specialization"} <= crossed


def test_every_subpackage_is_packaged() -> None:
    """pyproject.toml lists the packages a wheel holds: a subpackage left out is missing from
    it (the editable installs of ``make`` would not show it)."""
    import tomllib

    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    found = {_module_name(p) for p in PACKAGE.rglob("__init__.py")}
    assert found == listed


def test_no_module_is_over_450_lines() -> None:
    """One job per module: a module that grows past 450 lines is hiding a stage."""
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 450
    }
    assert not long, long
