"""The package's shape: no import cycle at run time, leaves stay leaves, short hot path."""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

import torch

import phi_torch_jit as ptj

PACKAGE = Path(ptj.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path) -> set[str]:
    """Package modules ``path`` imports anywhere (functions included), except under
    ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            target = f"{base}.{node.module}" if node.module else base
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)
        else:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found.update(n for n in names if n.startswith("phi_torch_jit"))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _runtime_imports(path) & set(modules) - {name} for name, path in modules.items()}


def test_no_import_cycle_at_run_time() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_lower_floors_do_not_import_higher_ones() -> None:
    graph = _graph()
    leaves = ("errors", "_compat", "_patches", "_sources", "_context", "_read_records")
    for leaf in leaves:
        allowed = {"phi_torch_jit.errors"} if leaf == "_compat" else set()
        assert graph[f"phi_torch_jit.{leaf}"] <= allowed, leaf
    for engine in ("engines", "engines.compile", "engines.torchscript", "engines.eager"):
        imported = graph[f"phi_torch_jit.{engine}"]
        assert "phi_torch_jit._context" not in imported, engine  # engines are told, not asking
        assert not any(m.startswith("phi_torch_jit._") and m.rsplit(".", 1)[-1] in
                       ("_jit", "_pipeline", "_trace", "_record", "_custom_op")
                       for m in imported), engine  # fmt: skip


def _modules_crossed(call: Any) -> set[str]:
    crossed: set[str] = set()
    root = str(PACKAGE)

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(root):
            crossed.add(Path(frame.f_code.co_filename).stem)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return crossed


def test_a_cache_hit_crosses_at_most_six_modules() -> None:
    """Core modules a cache hit runs Python of, beside the engine's own (engine "auto", the
    default: its tiered program and the parameters' requires_grad check; "torchscript": its
    unoptimized call of a differentiable program)."""
    engine_files = {p.stem for p in (PACKAGE / "engines").glob("*.py")}
    net = torch.nn.Linear(4, 4)

    @ptj.jit
    def step(x: torch.Tensor, scale: float = 2.0) -> dict[str, torch.Tensor]:
        return {"y": net(x) * scale}

    x = torch.randn(3, 4)
    step(x)
    step(x)  # engine "auto" (compiling on the caller in tests) switches in its second call
    measuring = _modules_crossed(lambda: step(x))  # its first calls are timed: one more
    assert len(measuring - engine_files) <= 7 and "_meter" in measuring, sorted(measuring)
    assert len(measuring & engine_files) <= 2, sorted(measuring)
    kept = ptj.jit(step.__wrapped__, fallback="off")  # compiled, whatever the machine measures
    kept(x)
    kept(x)
    crossed = _modules_crossed(lambda: kept(x))
    assert len(crossed - engine_files) <= 6, sorted(crossed)
    assert len(crossed & engine_files) <= 2, sorted(crossed)
    assert {"_jit", "_signature", "_specialization"} <= crossed


def test_every_subpackage_is_packaged() -> None:
    """pyproject.toml lists the packages a wheel holds: a subpackage left out is missing from
    it (the editable installs of ``make`` would not show it)."""
    import tomllib

    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    found = {_module_name(p) for p in PACKAGE.rglob("__init__.py")}
    assert found == listed
