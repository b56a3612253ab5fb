"""No module of model_executor imports one that imports it back, lazy and TYPE_CHECKING imports
included: the runner's start-up passes see it as a `runner_interface.StartUpRunner`."""

from __future__ import annotations

import ast
from pathlib import Path

import ferrum

ROOT = Path(ferrum.__file__).parent.parent
PACKAGE = ROOT / "ferrum" / "model_executor"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules an import statement anywhere in `path` names."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names & modules


def test_model_executor_has_no_import_cycle() -> None:
    paths = {_module(path): path for path in PACKAGE.rglob("*.py")}
    graph = {name: _imports(path, set(paths)) - {name} for name, path in paths.items()}
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> None:
        assert name not in stack, " -> ".join(stack[stack.index(name) :] + [name])
        if name not in done:
            for imported in sorted(graph[name]):
                visit(imported, [*stack, name])
            done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_start_up_passes_do_not_import_the_runner() -> None:
    for name in ("warm_up", "gpu_memory_profile"):
        modules = _imports(PACKAGE / f"{name}.py", {"ferrum.model_executor.model_runner"})
        assert not modules, name
