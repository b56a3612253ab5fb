"""Paged attention at the shapes of real traffic: a chunk after a cached prefix, and decode.

Prefill rows: `--batch` conversations, each a chunk of C new tokens after P cached ones, for every
(P, C) of `--shapes`; TFLOP/s counts each query's visible keys (4 * head_dim * heads * (C * P +
C^2 / 2) a conversation). Decode rows: `--decode-batch` requests of one token over each context of
`--decode-contexts`; GB/s counts the K and V bytes read. Qwen3-8B's heads by default, bf16, K/V in
pages scattered over a shuffled pool. Rows:
- `ferrum`: what the attention layer runs on such a step (the paged kernel, split-KV for small
  decode batches, or the SDPA path for a long chunk after a short prefix, `long_prefill_segments`);
- `ferrum paged`: the paged Triton kernel alone (prefill shapes);
- `fa4 pN`: FlashAttention-4's CuTe-DSL kernel (`flash_attn.cute`, when installed) on pages of N
  tokens (`--fa4-page-sizes`; 16 is ferrum's block, a key tile's worth loads by TMA).
Each row is checked against ferrum's paged kernel (max abs error printed).
Usage: python benchmarks/bench_chunk_attention.py [--shapes 0:8192,2048:2048] [--batch 1]
[--out file.json]
"""

# ruff: noqa: E402
import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.gpu_timing import launches_ms
from ferrum.kernels.paged_attention import paged_attention
from ferrum.kernels.sdpa_prefill import CachedContext, long_prefill_segments, sdpa_prefill
from ferrum.kernels.split_kv_plan import SplitKVWorkspace, split_kv_workspace_shapes

FERRUM_BLOCK = 16
SHAPES = "0:8192,2048:2048,3072:512,8192:2048,16384:4096"


def fa4_attention() -> Callable | None:
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


class PagedProblem:
    """`batch` requests of `chunk` queries over `context` keys, K/V written into a shuffled pool of
    pages of `page` tokens ([2, pages, page, kv_heads, dim], ferrum's layout; FA4 reads
    cache[0] and cache[1])."""

    def __init__(self, args, batch: int, chunk: int, context: int, page: int, gen) -> None:
        heads, kv_heads, dim = args.num_heads, args.num_kv_heads, args.head_dim
        pages_per_req = -(-context // page)
        pool = torch.randperm(batch * pages_per_req, device="cuda", generator=gen) + 1
        self.block_tables = pool.view(batch, pages_per_req).to(torch.int32)
        self.cache = torch.randn(
            2, batch * pages_per_req + 1, page, kv_heads, dim,
            device="cuda", dtype=torch.bfloat16, generator=gen,
        )  # fmt: skip
        self.query = torch.randn(
            batch * chunk, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen
        )
        self.starts = list(range(0, batch * chunk + 1, chunk))
        self.query_start_loc = torch.tensor(self.starts, device="cuda", dtype=torch.int32)
        self.seq_lens_cpu = [context] * batch
        self.seq_lens = torch.tensor(self.seq_lens_cpu, device="cuda", dtype=torch.int32)
        self.chunk, self.context, self.batch, self.page = chunk, context, batch, page
        self.scale = dim**-0.5
        self.out = torch.empty_like(self.query)
        # The chunk's own keys and values, token-major, as the layer hands them to SDPA.
        chunk_kv = [self.kv_rows(req)[:, context - chunk :] for req in range(batch)]
        self.chunk_k, self.chunk_v = torch.cat(chunk_kv, dim=1).unbind(0)

    def slots(self, req: int) -> torch.Tensor:
        """The cache slots of request `req`'s positions 0..context-1."""
        positions = torch.arange(self.context, device="cuda")
        return self.block_tables[req].long()[positions // self.page] * self.page + positions % (
            self.page
        )

    def kv_rows(self, req: int) -> torch.Tensor:
        """[2, context, kv_heads, dim]: request `req`'s keys and values in position order."""
        return self.cache.view(2, -1, *self.cache.shape[3:])[:, self.slots(req)]

    def copy_kv_from(self, other: "PagedProblem") -> None:
        """Writes `other`'s K/V (same requests, another page size) into this problem's pages."""
        for req in range(self.batch):
            self.cache.view(2, -1, *self.cache.shape[3:])[:, self.slots(req)] = other.kv_rows(req)

    def paged(self, workspace: SplitKVWorkspace | None) -> torch.Tensor:
        return paged_attention(
            self.query, self.cache, self.block_tables, self.query_start_loc, self.seq_lens,
            self.chunk, self.context, self.scale, self.out, workspace,
        )  # fmt: skip

    def layer(self, workspace: SplitKVWorkspace | None) -> torch.Tensor:
        """The attention layer's choice for this step (`Attention._attend_by_segments`)."""
        segments = long_prefill_segments(self.starts, self.seq_lens_cpu, self.context)
        if not segments:
            return self.paged(workspace)
        context = CachedContext(self.cache, self.block_tables, self.seq_lens_cpu)
        assert all(s.sdpa for s in segments)
        out = None if self.batch == 1 else self.out
        return sdpa_prefill(self.query, self.chunk_k, self.chunk_v, self.starts, self.scale, out,
                            context=context)  # fmt: skip

    def fa4(self, fn: Callable) -> torch.Tensor:
        return fn(
            self.query, self.cache[0], self.cache[1], cu_seqlens_q=self.query_start_loc,
            seqused_k=self.seq_lens, max_seqlen_q=self.chunk, page_table=self.block_tables,
            softmax_scale=self.scale, causal=True,
        )[0]  # fmt: skip


def run_rows(args, problem: PagedProblem, fa4: Callable | None, unit: float, label: str, gen):
    """Times and checks every row on one problem; `unit` converts ms to the printed figure."""
    workspace = SplitKVWorkspace(*(
        torch.empty(shape, device="cuda", dtype=torch.float32)
        for shape in _workspace_shapes(args, problem.batch)
    ))  # fmt: skip
    reference = problem.paged(workspace).clone()
    rows = {"ferrum": lambda: problem.layer(workspace)}
    if problem.chunk > 1:
        rows["ferrum paged"] = lambda: problem.paged(workspace)
    if fa4 is not None:
        for page in args.fa4_page_sizes:
            other = problem
            if page != problem.page:
                other = PagedProblem(args, problem.batch, problem.chunk, problem.context, page, gen)
                other.query = problem.query
                other.copy_kv_from(problem)
            rows[f"fa4 p{page}"] = lambda other=other: other.fa4(fa4)
    results = {}
    for name, fn in rows.items():
        try:
            err = (fn().float() - reference.float()).abs().max().item()
            ms = launches_ms(fn, args.iters)
        except Exception as exc:  # a kernel this build, GPU or shape does not take
            results[name] = {"unsupported": str(exc).splitlines()[0][:200]}
            print(f"  {label:18s} {name:14s} unsupported: {str(exc).splitlines()[0][:100]}")
            continue
        results[name] = {"ms": ms, "figure": unit / ms, "max_abs_err": err}
        print(f"  {label:18s} {name:14s} {ms:8.3f} ms {unit / ms:8.1f}  err {err:.1e}", flush=True)
    return results


def _workspace_shapes(args, batch: int):
    out_shape, stat_shape = split_kv_workspace_shapes(max(batch, 1), args.num_heads, args.head_dim)
    return out_shape, stat_shape, stat_shape


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=SHAPES, help="prefix:chunk pairs")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--decode-contexts", default="1024,4096,8192")
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--fa4-page-sizes", default="16,128")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.fa4_page_sizes = [int(p) for p in args.fa4_page_sizes.split(",") if p]
    gen = torch.Generator(device="cuda").manual_seed(0)
    fa4 = fa4_attention()
    print(f"{torch.cuda.get_device_name()}; FlashAttention-4: {'yes' if fa4 else 'not installed'}")
    results: dict = {"prefill_tflops": {}, "decode_gbps": {}}
    heads, kv_heads, dim = args.num_heads, args.num_kv_heads, args.head_dim
    print("prefill (TFLOP/s)")
    for pair in args.shapes.split(","):
        prefix, chunk = (int(x) for x in pair.split(":"))
        problem = PagedProblem(args, args.batch, chunk, prefix + chunk, FERRUM_BLOCK, gen)
        flops = args.batch * 4 * dim * heads * (chunk * prefix + chunk * chunk / 2)
        results["prefill_tflops"][pair] = run_rows(
            args, problem, fa4, flops / 1e9, f"P={prefix} C={chunk}", gen
        )
    print("decode (GB/s of K and V)")
    for context in (int(x) for x in args.decode_contexts.split(",") if x):
        problem = PagedProblem(args, args.decode_batch, 1, context, FERRUM_BLOCK, gen)
        kv_bytes = args.decode_batch * context * 2 * kv_heads * dim * 2
        results["decode_gbps"][str(context)] = run_rows(
            args, problem, fa4, kv_bytes / 1e6, f"B={args.decode_batch} L={context}", gen
        )
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
