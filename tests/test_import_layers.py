"""The package's imports run one way, bottom up (README, "How it works"):
kernels -> request, config, kv, ... -> scheduler -> model_executor, ... -> engine -> entrypoints,
bench. A module may import its own layer or a lower one, never a higher one, and no module
imports itself back through others; request.py, kv/ and scheduler/ never import torch. Checked
on the source with `ast`, lazy and TYPE_CHECKING imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import ferrum

PACKAGE = Path(ferrum.__file__).parent
# The layer of each top-level module or subpackage of ferrum, bottom up.
LAYERS = [
    # envs (a leaf: it imports only os) sits with kernels, whose PDL switch it reads.
    {"kernels", "envs"},
    {
        "request",
        "config",
        "config_fields",
        "device_config",
        "parallel_config",
        "recovery_config",
        "model_arch",
        "quant_config",
        "quant_config_int4",
        "logger",
        "sampling_params",
        "outputs",
        "default_model",
        "model_folder",
        "gguf",
        "errors",
        "kv",
        "structured_output",
        "structured_outputs_config",
        "lora_request",
        "lora_config",
        "lora_checkpoint",
        "speculative_config",
        "eagle3_config",
    },
    {"scheduler"},
    {"distributed", "executor", "model_executor", "lora"},
    {"engine"},
    {"entrypoints", "bench", "__main__"},
]
LAYER_OF = {name: level for level, names in enumerate(LAYERS) for name in names}
# Layers that never import torch at run time (a TYPE_CHECKING import names a type only).
TORCH_FREE = (
    "request",
    "kv",
    "scheduler",
    "structured_output",
    "errors",
    "sampling_params",
    "lora_request",
    "lora_config",
    "lora_checkpoint",
)


def _top(module: str) -> str:
    """The top-level name under ferrum of a dotted module path ("ferrum.kv.block_pool" -> kv)."""
    return module.split(".")[1]


def _imported_modules(tree: ast.AST) -> list[str]:
    """Every module an import statement names, with `from ferrum import X` resolved to the
    module that defines X (the lazy public names of ferrum/__init__.py included)."""
    modules = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            assert node.level == 0, "relative imports are not used in ferrum"
            if node.module != "ferrum":
                modules.append(node.module)
                continue
            for alias in node.names:
                if alias.name == "__version__":
                    continue  # defined in ferrum/__init__.py itself, which imports nothing
                submodule = PACKAGE / alias.name
                if submodule.is_dir() or submodule.with_suffix(".py").is_file():
                    modules.append(f"ferrum.{alias.name}")
                else:
                    modules.append(ferrum._LAZY[alias.name])
    return modules


def _package_modules() -> list[tuple[str, Path]]:
    return [
        (path.relative_to(PACKAGE).parts[0].removesuffix(".py"), path)
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.parent != PACKAGE or path.name != "__init__.py"
    ]


def test_every_module_has_a_layer() -> None:
    missing = {top for top, _ in _package_modules()} - set(LAYER_OF)
    assert not missing, f"give these a layer in LAYERS: {sorted(missing)}"


def test_no_import_runs_up_a_layer() -> None:
    violations = []
    for top, path in _package_modules():
        for module in _imported_modules(ast.parse(path.read_text(), str(path))):
            if module.startswith("ferrum.") and LAYER_OF[_top(module)] > LAYER_OF[top]:
                violations.append(f"{path.relative_to(PACKAGE.parent)} imports {module}")
    assert not violations, "\n".join(violations)


def _without_type_checking_blocks(tree: ast.Module) -> ast.Module:
    """`tree` less its `if TYPE_CHECKING:` blocks (imports there never run)."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            node.body = [  # type: ignore[attr-defined]
                child
                for child in body
                if not (isinstance(child, ast.If) and ast.unparse(child.test) == "TYPE_CHECKING")
            ]
    return tree


def test_torch_free_layers_do_not_import_torch() -> None:
    violations = [
        str(path.relative_to(PACKAGE.parent))
        for top, path in _package_modules()
        if top in TORCH_FREE
        for module in _imported_modules(
            _without_type_checking_blocks(ast.parse(path.read_text(), str(path)))
        )
        if module.split(".")[0] in ("torch", "triton")
    ]
    assert not violations, violations


def test_the_checker_sees_lazy_and_package_level_imports() -> None:
    source = (
        "def f():\n    from ferrum.engine.core import EngineCore\nfrom ferrum import envs, LLM\n"
    )
    modules = sorted(_imported_modules(ast.parse(source)))
    assert modules == ["ferrum.engine.core", "ferrum.entrypoints.llm", "ferrum.envs"]


def _module_graph() -> dict[str, set[str]]:
    """Each ferrum module (a package by its __init__) -> the ferrum modules it imports."""
    paths = {
        ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(
            ".__init__"
        ): path
        for path in PACKAGE.rglob("*.py")
    }

    def resolve(name: str) -> str:
        while name not in paths:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(resolve(a.name) for a in node.names if a.name.startswith("ferrum"))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ferrum"):
                edges.update(resolve(f"{node.module}.{a.name}") for a in node.names)
        graph[name] = edges - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as a path (first module repeated at the end), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return None
        path.append(module)
        for imported in sorted(graph[module]):
            if (found := visit(imported)) is not None:
                return found
        path.pop()
        done.add(module)
        return None

    return next((c for module in sorted(graph) if (c := visit(module)) is not None), None)


def test_no_module_imports_itself_back() -> None:
    cycle = _cycle(_module_graph())
    assert cycle is None, " -> ".join(cycle or ())


def test_the_cycle_finder_finds_one() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
