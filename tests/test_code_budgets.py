"""Budgets the package keeps (checked on the source with `ast`): no module over 400 lines, no
function over 80 lines but the listed exceptions, docstrings of a few lines, and os.environ
touched only by envs.py."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import ferrum

PACKAGE = Path(ferrum.__file__).parent
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
MAX_DOCSTRING_LINES = 12
# A Triton kernel is one compiled program: its loads, math and stores share registers and are
# scheduled together, so it stays one function (helpers it calls are inlined anyway).
_TRITON_KERNEL = "one Triton kernel"
FUNCTION_EXCEPTIONS = {
    "kernels/causal_conv1d.py:_causal_conv1d_kernel": _TRITON_KERNEL,
    "kernels/fp8_gemm.py:_fp8_gemm_kernel": _TRITON_KERNEL,
    "kernels/fp8_gemm_wgmma_kernel.py:_w8a8_block_wgmma_kernel": _TRITON_KERNEL,
    "kernels/fused_moe.py:_moe_gemm_kernel": _TRITON_KERNEL,
    "kernels/fused_moe_small_batch.py:_moe_down_combine_gemv_kernel": _TRITON_KERNEL,
    "kernels/gated_delta_rule_prefill.py:_gated_delta_rule_prefill_kernel": _TRITON_KERNEL,
    "kernels/paged_attention.py:_paged_attention_kernel": _TRITON_KERNEL,
    "kernels/paged_attention_split_kv.py:_paged_attention_split_kernel": _TRITON_KERNEL,
    "kernels/rotary_kv.py:_rotary_kv_kernel": _TRITON_KERNEL,
}


@functools.cache
def _modules() -> list[tuple[str, Path, ast.Module]]:
    """Every module of the package, parsed once for all the checks here (they only read it)."""
    return [
        (str(path.relative_to(PACKAGE)), path, ast.parse(path.read_text(), str(path)))
        for path in sorted(PACKAGE.rglob("*.py"))
    ]


def test_no_module_is_over_its_budget() -> None:
    over = [
        f"{name}: {n} lines"
        for name, path, _ in _modules()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not over, over


def test_no_function_is_over_its_budget_but_the_listed_ones() -> None:
    over = []
    for name, _, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                key = f"{name}:{node.name}"
                size = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if size > MAX_FUNCTION_LINES and key not in FUNCTION_EXCEPTIONS:
                    over.append(f"{key}: {size} lines")
    assert not over, over


def test_every_listed_exception_is_still_needed() -> None:
    sizes = {
        f"{name}:{node.name}": node.end_lineno - node.lineno + 1  # type: ignore[operator]
        for name, _, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    stale = [key for key in FUNCTION_EXCEPTIONS if sizes.get(key, 0) <= MAX_FUNCTION_LINES]
    assert not stale, stale


def test_docstrings_are_a_few_lines() -> None:
    long = []
    for name, _, tree in _modules():
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
            if not isinstance(node, kinds) or not body:
                continue
            first = body[0]
            is_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            if is_doc and isinstance(first.value.value, str):  # type: ignore[attr-defined]
                size = first.end_lineno - first.lineno + 1  # type: ignore[operator]
                if size > MAX_DOCSTRING_LINES:
                    long.append(f"{name}:{getattr(node, 'name', '<module>')}: {size} lines")
    assert not long, long


def test_only_envs_touches_the_environment() -> None:
    touching = [
        f"{name}:{node.lineno}"
        for name, _, tree in _modules()
        if name != "envs.py"
        for node in ast.walk(tree)
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("environ", "getenv", "putenv", "unsetenv")
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        )
        or (isinstance(node, ast.ImportFrom) and node.module == "os")
    ]
    assert not touching, touching
