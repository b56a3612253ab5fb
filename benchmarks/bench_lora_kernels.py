"""The LoRA kernels beside the base GEMM of each Qwen3-8B LoRA layer (GPU): per token count,
microseconds of the base F.linear, of the base GEMM + shrink + expand (`lora_us`, the path of
weights kept apart, e.g. FP8 bases), and of what a model-dtype layer runs: the extended weight's
GEMM (`ext_gemm_us`, every slot's A below W) then `lora_expand_extended` (`ext_us` both).
`--slots` adapters of rank `--rank` in the pool, the tokens spread over `--used` of them, timed
in CUDA graphs as the engine runs them. The ratio columns are what an adapter adds to the layer.

    python benchmarks/bench_lora_kernels.py                        # H100/H200, bf16
    TRITON_INTERPRET=1 python benchmarks/bench_lora_kernels.py --smoke   # CPU: the script runs
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferrum.kernels.dense_linear import dense_linear, gemv_tile_for  # noqa: E402
from ferrum.kernels.gemv_lora import gemv_lora, new_t_scratch  # noqa: E402
from ferrum.kernels.lora_expand import lora_expand, lora_expand_extended  # noqa: E402
from ferrum.kernels.lora_segments import LoRASegments  # noqa: E402
from ferrum.kernels.lora_shrink import lora_shrink  # noqa: E402

# Qwen3-8B: (layer, input features, output features of each shard).
LAYERS = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (12288, 12288)),
    "down": (12288, (4096,)),
}
# Copies of a layer the one-row timings cycle over (4 x the largest layer's 192 MB > any L2).
WEIGHT_COPIES = 4
SMOKE_LAYERS = {"qkv": (64, (64, 16, 16)), "down": (96, (64,))}


def run_layer(x, weight, lora_a, lora_b, segments, starts) -> None:  # noqa: ANN001
    """A quantized base's path: the base GEMM, the shrink, one expand over every shard."""
    y = torch.nn.functional.linear(x, weight)
    t = lora_shrink(x, lora_a, segments)
    lora_expand(t, lora_b, segments, y, starts)


def extended_layer(x, extended, lora_b, segments, starts, device, iters):  # noqa: ANN001, ANN201
    """(microseconds of the extended GEMM alone, of the GEMM then the expand)."""
    n = lora_b.shape[1]
    gemm = partial(torch.nn.functional.linear, x, extended)

    def both() -> None:
        lora_expand_extended(torch.nn.functional.linear(x, extended), n, lora_b, segments, starts)

    return timed_us(gemm, device, iters), timed_us(both, device, iters)


def one_row_gemv(x, weight, lora_a, lora_b, slots, starts, device, iters) -> None:  # noqa: ANN001
    """What the engine runs at one row: the GEMV alone, then with the adapter in one launch,
    each cycling over WEIGHT_COPIES copies of the layer (so its weights stream from HBM, not
    L2) and after a raise of the forward's number (a one-element add, in both timings: the
    engine raises it once per forward)."""
    tile = gemv_tile_for(x, weight)
    if tile is None:
        return  # off CUDA, or the table sends this shape to F.linear
    layers = [(weight, lora_a, lora_b)] + [
        (weight.clone(), lora_a.clone(), lora_b.clone()) for _ in range(WEIGHT_COPIES - 1)
    ]
    scratches = [new_t_scratch(weight, tile, len(starts), lora_b.shape[2]) for _ in layers]
    seq = torch.zeros(1, dtype=torch.int32, device=device)

    def gemv(i: int) -> None:
        seq.add_(1)
        dense_linear(x, layers[i][0])

    def fused(i: int) -> None:
        seq.add_(1)
        gemv_lora(x, *layers[i], slots, starts, tile, scratches[i], seq)

    from benchmarks.gpu_timing import graph_us

    base_us = graph_us(gemv, WEIGHT_COPIES, iters)
    fused_us = graph_us(fused, WEIGHT_COPIES, iters)
    print(f"{'':15s} one-row GEMV {base_us:.1f} us, with its adapter in one launch {fused_us:.1f}")


def timed_us(fn, device: torch.device, iters: int) -> float:  # noqa: ANN001
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e6 / iters
    from benchmarks.gpu_timing import graph_us

    return graph_us(lambda _: fn(), 1, iters)


def _tiles(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in tile.split("x")) for tile in text.split(",") if tile]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,8,32,128,512,2048,8192")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--used", type=int, default=8, help="adapters the tokens use")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any device")
    parser.add_argument(
        "--expand-tiles", default="", type=_tiles, help="e.g. 128x4,256x8: expand tiles to time"
    )
    parser.add_argument(
        "--ext-tiles", default="", type=_tiles, help="e.g. 128x4: extended expand tiles to time"
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("needs CUDA (or --smoke with TRITON_INTERPRET=1)")
        return 1
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    layers = SMOKE_LAYERS if args.smoke else LAYERS
    tokens = [1, 8] if args.smoke else [int(t) for t in args.tokens.split(",")]
    print("layer    tokens  base_us  lora_us  lora/base  shrink_us  expand_us  ext_gemm_us  "
          "ext_us  ext/base")  # fmt: skip
    for name, (k, shards) in layers.items():
        n = sum(shards)
        weight = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        lora_a = torch.randn(args.slots, len(shards) * args.rank, k, device=device, dtype=dtype)
        lora_b = torch.randn(args.slots, n, args.rank, device=device, dtype=dtype) * 0.01
        extended = torch.cat([weight, lora_a.reshape(-1, k)])  # what a model-dtype layer holds
        starts = tuple(sum(shards[:i]) for i in range(len(shards)))
        for num_tokens in tokens:
            x = torch.randn(num_tokens, k, device=device, dtype=dtype)
            slots = torch.arange(num_tokens, device=device, dtype=torch.int32) % args.used
            segments = LoRASegments.empty(num_tokens, args.slots, device)
            segments.fill(slots)
            iters = 2 if args.smoke else args.iters
            base = timed_us(partial(torch.nn.functional.linear, x, weight), device, iters)
            lora = partial(run_layer, x, weight, lora_a, lora_b, segments, starts)
            with_lora = timed_us(lora, device, iters)
            shrink = timed_us(partial(lora_shrink, x, lora_a, segments), device, iters)
            t = lora_shrink(x, lora_a, segments)
            y = torch.nn.functional.linear(x, weight)
            expand = timed_us(partial(lora_expand, t, lora_b, segments, y, starts), device, iters)
            ext_gemm, ext = extended_layer(x, extended, lora_b, segments, starts, device, iters)
            print(
                f"{name:8s} {num_tokens:6d} {base:8.1f} {with_lora:8.1f} {with_lora / base:9.2f} "
                f"{shrink:10.1f} {expand:10.1f} {ext_gemm:12.1f} {ext:7.1f} {ext / base:9.2f}"
            )
            for block_n, warps in args.expand_tiles:
                tiled = partial(lora_expand, t, lora_b, segments, y, starts, block_n, warps)
                print(f"{'':15s} expand BLOCK_N {block_n}, {warps} warps: "
                      f"{timed_us(tiled, device, iters):.1f} us")  # fmt: skip
            y_ext = torch.nn.functional.linear(x, extended)
            for block_n, warps in args.ext_tiles:
                tiled = partial(lora_expand_extended, y_ext, n, lora_b, segments, starts, block_n,
                                warps)  # fmt: skip
                print(f"{'':15s} extended expand BLOCK_N {block_n}, {warps} warps: "
                      f"{timed_us(tiled, device, iters):.1f} us")  # fmt: skip
            if num_tokens == 1:
                one_row_gemv(x, weight, lora_a, lora_b, slots, starts, device, iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
