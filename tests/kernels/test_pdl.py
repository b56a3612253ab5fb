"""Programmatic dependent launch (kernels/pdl.py): its invariants checked on the source, and on a
Hopper GPU a chain of decode kernels replayed in a CUDA graph with PDL against plain launches
(bit for bit: PDL changes when a kernel starts, never what it computes)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from ferrum.kernels import pdl
from ferrum.kernels.activation import silu_and_mul
from ferrum.kernels.fp8_gemv import fp8_gemv
from ferrum.kernels.fp8_weight import quantize_weight_block, quantize_weight_per_channel
from ferrum.kernels.fused_moe import fused_moe
from ferrum.kernels.gemv import gemv
from ferrum.kernels.moe_router import moe_router
from ferrum.kernels.paged_attention_split_kv import paged_attention_split_kv
from ferrum.kernels.rms_norm import fused_add_rms_norm, rms_norm
from ferrum.kernels.rotary_kv import rotary_kv
from ferrum.kernels.rotary_kv_ref import compute_cos_sin
from ferrum.kernels.split_kv_plan import allocate_split_kv_workspace

KERNEL_DIR = Path(pdl.__file__).parent
HOPPER = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < pdl.MIN_PDL_CAPABILITY,
    reason="PDL needs a CUDA GPU of sm90 or later",
)


def _jit_kernels_with_pdl() -> list[tuple[str, ast.FunctionDef]]:
    kernels = []
    for path in sorted(KERNEL_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and "USE_PDL" in [a.arg for a in node.args.args]:
                kernels.append((f"{path.name}:{node.name}", node))
    return kernels


def _calls(node: ast.AST, name: str) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name
    ]


def test_off_the_gpu_kernels_launch_plainly() -> None:
    assert not pdl.uses_pdl(torch.device("cpu"))


# Before its wait a PDL kernel may load only through these (weights and their scales, never
# written while serving), indexed by offsets (names starting with "offs").
WEIGHT_POINTERS = {"weight_ptr", "w_ptrs", "s_row", "w_scale_ptrs"}


def _pointer_names(call: ast.Call) -> set[str]:
    return {
        n.id
        for n in ast.walk(call.args[0])
        if isinstance(n, ast.Name) and not n.id.startswith("offs")
    }


def _called_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _is_pdl_wait(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Call)
        and _called_name(stmt.value) == "pdl_wait"
    )


def test_every_pdl_kernel_waits_first_at_its_top_level() -> None:
    """Each kernel taking USE_PDL lets the next one launch, then calls pdl_wait as a statement of
    its body (so every program reaches it); before that it stores nothing, returns nowhere and
    loads only weights."""
    kernels = [k for k in _jit_kernels_with_pdl() if not k[0].endswith(("pdl_wait", "_dependents"))]
    names = {name.split(":")[1] for name, _ in kernels}
    assert {"_gemv_kernel", "_fp8_gemv_kernel", "_rms_norm_kernel"} <= names
    assert len(kernels) >= 10
    for name, fn in kernels:
        body = [
            stmt
            for stmt in fn.body
            if not isinstance(stmt, ast.Expr) or not isinstance(stmt.value, ast.Constant)
        ]  # the docstring
        assert _calls(body[0], "pdl_launch_dependents"), f"{name} must let the next kernel launch"
        waits = [i for i, stmt in enumerate(body) if _is_pdl_wait(stmt)]
        assert waits, f"{name} takes USE_PDL but has no top-level pdl_wait"
        before = ast.Module(body=body[: waits[0]], type_ignores=[])
        for node in ast.walk(before):
            assert not isinstance(node, ast.Return), f"{name} returns before its pdl_wait"
            if not isinstance(node, ast.Call):
                continue
            called = _called_name(node)
            assert "store" not in called and "atomic" not in called, f"{name}: {called} pre-wait"
            if "load" in called:
                loaded = _pointer_names(node)
                assert loaded <= WEIGHT_POINTERS, f"{name} loads {loaded} before its pdl_wait"


def test_pdl_launch_args_pair_the_flag_with_the_launch_option(monkeypatch) -> None:
    assert pdl.pdl_launch_args(torch.device("cpu")) == {"USE_PDL": False}
    monkeypatch.setattr(pdl, "_device_takes_pdl", lambda index: True)
    assert pdl.pdl_launch_args(torch.device("cuda", 0)) == {"USE_PDL": True, "launch_pdl": True}


def test_every_pdl_launch_passes_the_same_flag_to_the_kernel() -> None:
    """No launch sets USE_PDL or launch_pdl by hand: every file with a PDL kernel launches it
    with **pdl_launch_args(device), which sets both together."""
    spreads = 0
    for path in sorted(KERNEL_DIR.glob("*.py")):
        if path.name == "pdl.py":
            continue
        tree = ast.parse(path.read_text())
        has_pdl_kernel = any(
            isinstance(n, ast.FunctionDef) and "USE_PDL" in [a.arg for a in n.args.args]
            for n in ast.walk(tree)
        )
        found = 0
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                named = [k.arg for k in node.keywords if k.arg is not None]
                spread = [ast.unparse(k.value) for k in node.keywords if k.arg is None]
            elif isinstance(node, ast.Dict):
                named = [ast.literal_eval(k) for k in node.keys if isinstance(k, ast.Constant)]
                spread = [ast.unparse(v) for k, v in zip(node.keys, node.values) if k is None]
            else:
                continue
            assert not {"USE_PDL", "launch_pdl"} & set(named), (
                f"{path.name}:{node.lineno} sets the PDL flag by hand"
            )
            found += sum(s.startswith("pdl_launch_args(") for s in spread)
        assert (found > 0) == has_pdl_kernel, f"{path.name}: PDL kernels without pdl_launch_args"
        spreads += found
    assert spreads >= 8


def _decode_chain(weights: dict, x: torch.Tensor, kv: dict) -> torch.Tensor:
    """One decode token through kernels in a decoder layer's order, twice (two layers)."""
    residual = x.clone()
    h = rms_norm(x, weights["norm"], 1e-6)
    for _ in range(2):
        qkv = gemv(h, weights["qkv"], block_n=4, block_k=512)
        q, k, v = qkv.split([kv["q_size"], kv["kv_size"], kv["kv_size"]], dim=-1)
        q = q.view(1, -1, kv["head_dim"])
        k = k.view(1, -1, kv["head_dim"])
        v = v.view(1, -1, kv["head_dim"])
        rotary_kv(
            q,
            k,
            v,
            kv["cos"],
            kv["sin"],
            kv["cache"],
            kv["slot"],
            positions=kv["pos"],
            q_norm_weight=weights["qk_norm"],
            k_norm_weight=weights["qk_norm"],
        )
        attn = torch.empty_like(q)
        paged_attention_split_kv(
            q, kv["cache"], kv["tables"], kv["seq_lens"], 4096, 0.1, attn, kv["workspace"]
        )
        o = fp8_gemv(attn.view(1, -1), *weights["o"], x.dtype, True, 16, 512)
        fused_add_rms_norm(o, residual, weights["norm"], 1e-6)
        gate_up = fp8_gemv(o, *weights["gate_up"], x.dtype, False, 8, 1024)
        act = silu_and_mul(gate_up)
        h = gemv(act, weights["down"], block_n=4, block_k=1024)
        logits = gemv(h, weights["router"], block_n=4, block_k=256)
        topk_weights, topk_ids = moe_router(logits, 2, True)
        h = h + fused_moe(h, weights["w13"], weights["w2"], topk_weights, topk_ids)
        fused_add_rms_norm(h, residual, weights["norm"], 1e-6)
    return torch.cat([h, residual], dim=-1)


def _chain_inputs(device: torch.device) -> tuple[dict, dict]:
    gen = torch.Generator().manual_seed(0)
    hidden, heads, kv_heads, head_dim, inter, experts = 1024, 8, 2, 128, 4096, 16

    def rand(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device, torch.bfloat16)

    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    weights = {
        "norm": rand(hidden, scale=1.0),
        "qk_norm": rand(head_dim, scale=1.0),
        "qkv": rand(q_size + 2 * kv_size, hidden),
        "o": tuple(t.to(device) for t in quantize_weight_block(torch.randn(hidden, q_size))),
        "gate_up": tuple(
            t.to(device) for t in quantize_weight_per_channel(torch.randn(2 * inter, hidden))
        ),
        "down": rand(hidden, inter),
        "router": rand(experts, hidden),
        "w13": rand(experts, 2 * 256, hidden),
        "w2": rand(experts, hidden, 256),
    }
    block_size, num_blocks, seq_len = 16, 300, 3000
    cos_sin = torch.cat(compute_cos_sin(4096, head_dim, 10000.0), dim=-1).to(device)
    cos, sin = cos_sin.chunk(2, dim=-1)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    kv = {
        "q_size": q_size,
        "kv_size": kv_size,
        "head_dim": head_dim,
        "cos": cos,
        "sin": sin,
        "cache": cache.to(device, torch.bfloat16),
        "pos": torch.tensor([seq_len - 1], device=device),
        "slot": torch.tensor([seq_len - 1], device=device),
        "tables": torch.randperm(num_blocks, generator=gen)[None, : seq_len // block_size + 1]
        .to(device, torch.int32)
        .contiguous(),
        "seq_lens": torch.tensor([seq_len], dtype=torch.int32, device=device),
        "workspace": allocate_split_kv_workspace(1, heads, head_dim, device),
    }
    return weights, kv


@HOPPER
def test_decode_chain_in_a_graph_matches_plain_launches(monkeypatch) -> None:
    device = torch.device("cuda")
    weights, kv = _chain_inputs(device)
    static_x = torch.empty(1, 1024, dtype=torch.bfloat16, device=device)
    inputs = [
        torch.randn(1, 1024, generator=torch.Generator().manual_seed(s)).to(device, torch.bfloat16)
        for s in range(20)
    ]
    clean_cache = kv["cache"].clone()

    monkeypatch.setattr(pdl, "_device_takes_pdl", lambda index: False)
    expected = []
    for x in inputs:
        kv["cache"].copy_(clean_cache)
        expected.append(_decode_chain(weights, x, kv))

    monkeypatch.setattr(pdl, "_device_takes_pdl", lambda index: True)
    assert pdl.uses_pdl(device)
    static_x.copy_(inputs[0])
    _decode_chain(weights, static_x, kv)  # compiles the PDL variants outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _decode_chain(weights, static_x, kv)
    for x, want in zip(inputs, expected):
        kv["cache"].copy_(clean_cache)
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, want)
