"""The runner's start-up passes see it as a `runner_interface.StartUpRunner`: they never import
it, lazily or under TYPE_CHECKING (`tests/test_import_layers.py` checks the package for cycles)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ferrum.model_executor

PACKAGE = Path(ferrum.model_executor.__file__).parent


@pytest.mark.parametrize("name", ["warm_up", "gpu_memory_profile"])
def test_start_up_passes_do_not_import_the_runner(name: str) -> None:
    imported = set()
    for node in ast.walk(ast.parse((PACKAGE / f"{name}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            imported.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert "ferrum.model_executor.model_runner" not in imported
