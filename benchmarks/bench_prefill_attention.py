"""Causal prefill attention of one long prompt: ferrum's paged kernel against torch's SDPA.

One request whose chunk is its whole prompt (--seq-len queries over --seq-len keys, the KV in
16-token blocks scattered over a shuffled pool), Qwen3-8B's heads by default (32 query heads, 8 KV
heads, head_dim 128), bf16. The references are `scaled_dot_product_attention(is_causal=True)` on
contiguous [1, heads, seq, head_dim] tensors, forced to each backend that takes them (flash, cuDNN,
efficient); K and V are repeated to the query heads outside the timing. The `sdpa_prefill` rows
time ferrum's SDPA path (kernels/sdpa_prefill.py) as the layer runs it on a step of this one
prompt: the copy into its padded buffer included. Prints milliseconds and TFLOP/s (causal:
2 * seq^2 * head_dim * heads). --prefix-len P puts P cached tokens before the chunk (a later chunk
of a long prompt): the `sdpa_prefill` rows then run the square problem over the whole context
that the layer runs (queries after zero rows, keys and values gathered from the cache), and
plain SDPA's rows are left out (its causal mask is aligned top-left). --sweep also times the
paged kernel at each key tile, warp count and pipeline depth.
Usage: python benchmarks/bench_prefill_attention.py [--seq-len 8000] [--prefix-len 0] [--sweep]
[--out file.json]
"""

# ruff: noqa: E402
import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.runtime.errors import OutOfResources

from benchmarks.gpu_timing import launches_ms
from ferrum.kernels.paged_attention import paged_attention, paged_attention_unified
from ferrum.kernels.sdpa_prefill import PREFILL_BACKENDS, CachedContext, sdpa_prefill

BLOCK_SIZE = 16


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8000)
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--prefix-len", type=int, default=0)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    seq, heads, kv_heads, dim = args.seq_len, args.num_heads, args.num_kv_heads, args.head_dim
    context = args.prefix_len + seq
    gen = torch.Generator(device="cuda").manual_seed(0)
    # Views of one packed projection output, as the models hand them to the attention layer.
    qkv = torch.randn(
        context, (heads + 2 * kv_heads) * dim, device="cuda", dtype=torch.bfloat16, generator=gen
    )
    query, keys, values = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    query = query[args.prefix_len :].view(seq, heads, dim)
    keys, values = keys.view(context, kv_heads, dim), values.view(context, kv_heads, dim)
    num_blocks = -(-context // BLOCK_SIZE)
    pool = torch.randperm(num_blocks, device="cuda", generator=gen) + 1
    kv_cache = torch.zeros(
        2, num_blocks + 1, BLOCK_SIZE, kv_heads, dim, device="cuda", dtype=torch.bfloat16
    )
    positions = torch.arange(context, device="cuda")
    slots = pool[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    kv_cache[0].view(-1, kv_heads, dim)[slots] = keys
    kv_cache[1].view(-1, kv_heads, dim)[slots] = values
    scale = dim**-0.5
    out = torch.empty_like(query)
    paged = dict(
        query=query,
        kv_cache=kv_cache,
        block_tables=pool.view(1, -1).to(torch.int32),
        query_start_loc=torch.tensor([0, seq], device="cuda", dtype=torch.int32),
        seq_lens=torch.tensor([context], device="cuda", dtype=torch.int32),
        max_query_len=seq,
        max_seq_len=context,
        scale=scale,
        out=out,
    )
    q4 = query.transpose(0, 1).unsqueeze(0).contiguous()
    group = heads // kv_heads
    k4 = keys.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0).contiguous()
    v4 = values.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0).contiguous()
    # Query i sees prefix_len + i + 1 keys: 4 * dim * heads flops per (query, key) pair.
    flops = 4 * dim * heads * (seq * args.prefix_len + seq * seq / 2)
    results = {
        "seq_len": seq,
        "prefix_len": args.prefix_len,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": dim,
        "rows": {},
    }

    def record(name: str, fn) -> None:
        try:
            ms = launches_ms(fn, args.iters)
        # A backend or tile this build or shape does not take.
        except (RuntimeError, OutOfResources) as exc:
            results["rows"][name] = {"unsupported": str(exc).splitlines()[0][:200]}
            print(f"{name:22s} unsupported: {str(exc).splitlines()[0][:120]}")
            return
        results["rows"][name] = {"ms": ms, "tflops": flops / ms / 1e9}
        print(f"{name:22s} {ms:8.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s", flush=True)

    record("ferrum", lambda: paged_attention(**paged))
    if args.sweep:
        unified = {k: v for k, v in paged.items() if k != "max_seq_len"}
        for block_n, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
            tile = dict(block_n=block_n, num_warps=warps, num_stages=stages)
            name = f"ferrum n{block_n} w{warps} s{stages}"
            record(name, lambda tile=tile: paged_attention_unified(**unified, **tile))
    # ferrum's SDPA path as the layer runs it on a step of this one chunk (packed, padded), per
    # backend, then with its backend order.
    cached = CachedContext(kv_cache, paged["block_tables"], [context])
    chunk_kv = (keys[args.prefix_len :], values[args.prefix_len :])
    for name, backends in (
        ("sdpa_prefill cudnn", [SDPBackend.CUDNN_ATTENTION]),
        ("sdpa_prefill flash", [SDPBackend.FLASH_ATTENTION]),
        ("sdpa_prefill", PREFILL_BACKENDS),
    ):
        record(
            name,
            lambda backends=backends: sdpa_prefill(
                query, *chunk_kv, [0, seq], scale, None, backends, cached
            ),
        )
    if args.prefix_len:
        paged_attention(**paged)
        ours = sdpa_prefill(query, query, query, [0, seq], scale, None, context=cached)
        err = (ours.float() - out.float()).abs().max().item()
        results["sdpa_prefill_max_abs_err_vs_ferrum"] = err
        print(f"sdpa_prefill against the paged kernel: max abs err {err:.2e}")
        if args.out is not None:
            args.out.write_text(json.dumps(results, indent=1))
        return 0
    reference = None
    for name, backend in (
        ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
        ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
        ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):
        with sdpa_kernel(backend):
            record(
                name,
                lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale),
            )
            if reference is None and "ms" in results["rows"][name]:
                reference = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)
    if reference is not None:
        paged_attention(**paged)
        err = (out.transpose(0, 1).unsqueeze(0).float() - reference.float()).abs().max().item()
        results["ferrum_max_abs_err_vs_sdpa"] = err
        print(f"ferrum against SDPA: max abs err {err:.2e}")
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
