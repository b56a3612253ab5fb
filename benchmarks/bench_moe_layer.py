"""Times the whole Triton MoE layer (router + fused experts) inside a CUDA graph, per token count.

Qwen3-30B-A3B shapes by default, bf16. `--layers` distinct weight sets (each with its own random
router logits) run in sequence in one captured graph, so that expert weights come from HBM and not
from the 50 MB L2. The graph is replayed after a warm-up; each replay is timed with CUDA events and
the median replay time divided by the number of layers is the per-layer time. GB/s counts each
distinct active expert's weights (w13 + w2) once per layer.
Path `grouped_mm` is the same layer on torch._grouped_mm (sort by expert, two grouped GEMMs,
weighted index_add): the comparison the Triton kernels are kept against.
--fp8: FP8 experts (128x128 block scales applied in the kernels; GB/s counts one byte per
weight), W8A8 where fused_moe_rule.uses_fp8_activations says (bench_moe_w8a8.py times both
forms); grouped_mm then is not run, and --save writes the `_fp8` file of the shape.
Usage: python benchmarks/bench_moe_layer.py [--tokens 1,2,4,8] [--path small|grouped|auto|
       grouped_mm] [--fp8] [--sweep [--save DIR]] [--out results.json]
"""

# ruff: noqa: E402
import argparse
import itertools
import json
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import triton

from benchmarks.gpu_timing import graph_replay_ms
from ferrum.kernels.device_properties import device_properties
from ferrum.kernels.fp8_weight import quantize_weight_block
from ferrum.kernels.fused_moe import fused_moe
from ferrum.kernels.fused_moe_config import save_section
from ferrum.kernels.fused_moe_rule import moe_configs
from ferrum.kernels.moe_router import moe_router

DTYPE = torch.bfloat16
# small_batch_max_tokens per path: force the small path, force the grouped path, or the default.
PATH_LIMITS: dict[str, int | None] = {"small": 1 << 30, "grouped": 0, "auto": None}
PATHS = (*PATH_LIMITS, "grouped_mm")
SMALL_PATH_MAX_TOKENS = 16
WARMUP_REPLAYS = 5


@dataclass
class Layer:
    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    logits: torch.Tensor  # [max_tokens, E]
    w13_scale: torch.Tensor | None = None  # [E, 2I / 128, H / 128] with FP8 experts
    w2_scale: torch.Tensor | None = None  # [E, H / 128, I / 128]


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [quantize_weight_block(w[e]) for e in range(w.shape[0])]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


@dataclass
class Result:
    tokens: int
    path: str
    us_per_layer: float
    gbps: float
    active_experts: float  # mean distinct experts per layer
    config: dict[str, int] | None


def random_layer_weights(
    args: argparse.Namespace, max_tokens: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer of `--layers`: bf16 experts w13 and w2 (std 0.02) and router logits for
    max_tokens rows, from one seeded generator."""
    e, h, i = args.experts, args.hidden, args.intermediate
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(args.layers):
        w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=DTYPE, generator=gen) * 0.02
        w2 = torch.randn(e, h, i, device="cuda", dtype=DTYPE, generator=gen) * 0.02
        yield w13, w2, torch.randn(max_tokens, e, device="cuda", dtype=DTYPE, generator=gen)


def make_layers(args: argparse.Namespace, max_tokens: int) -> list[Layer]:
    layers = []
    for w13, w2, logits in random_layer_weights(args, max_tokens):
        if args.fp8:
            (w13, s13), (w2, s2) = quantize_experts(w13), quantize_experts(w2)
            layers.append(Layer(w13, w2, logits, s13, s2))
        else:
            layers.append(Layer(w13, w2, logits))
    return layers


def active_experts(layers: list[Layer], tokens: int, top_k: int) -> float:
    """Mean number of distinct experts the router picks per layer for the first `tokens` rows."""
    counts = [
        torch.unique(moe_router(layer.logits[:tokens], top_k, True)[1]).numel() for layer in layers
    ]
    return sum(counts) / len(counts)


def time_layer_us(
    layers: list[Layer],
    hidden: torch.Tensor,
    top_k: int,
    limit: int | None,
    small_config: dict[str, int] | None,
    replays: int,
) -> float:
    """Median per-layer microseconds of one graph replay running every layer in sequence."""
    tokens = hidden.shape[0]

    def run() -> list[torch.Tensor]:
        outs = []
        for layer in layers:
            weights, ids = moe_router(layer.logits[:tokens], top_k, True)
            if small_config is GROUPED_MM:
                outs.append(grouped_mm_moe(hidden, layer.w13, layer.w2, weights, ids))
                continue
            outs.append(
                fused_moe(
                    hidden,
                    layer.w13,
                    layer.w2,
                    weights,
                    ids,
                    small_config=small_config,
                    small_batch_max_tokens=limit,
                    w13_scale=layer.w13_scale,
                    w2_scale=layer.w2_scale,
                )
            )
        return outs

    return graph_replay_ms(run, replays, WARMUP_REPLAYS) * 1e3 / len(layers)


GROUPED_MM: dict[str, int] = {}  # marks the torch._grouped_mm path in time_layer_us


def grouped_mm_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The MoE layer on torch._grouped_mm, without host syncs (graph safe)."""
    num_experts, inter = w2.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=hidden.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    tokens = order // top_k
    gate_up = torch._grouped_mm(hidden[tokens], w13.transpose(1, 2), offs=offs)
    act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    down = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
    weighted = down.float() * topk_weights.reshape(-1)[order][:, None]
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    return out.index_add_(0, tokens, weighted).to(hidden.dtype)


def sweep_configs(top_k: int) -> list[dict[str, int]]:
    # The down GEMV's tile [DOWN_BLOCK_E, DOWN_BLOCK_N, DOWN_BLOCK_K] spans one choice at a time
    # (with the wide tiles) or all k choices (with narrow ones); split tiles (DOWN_SPLIT) run
    # each choice on programs of their own, the last of a token's to finish summing them.
    # dict.fromkeys: with k = 1 both halves name one-choice tiles, timed once.
    down_tiles = list(
        dict.fromkeys(
            [
                *((1, 0, n, k) for n, k in itertools.product((4, 8, 16), (256, 1024))),
                *(
                    (triton.next_power_of_2(top_k), 0, n, k)
                    for n, k in itertools.product((4, 8), (128, 256))
                ),
                *((1, 1, n, k) for n, k in itertools.product((8, 16, 32, 64), (256, 512))),
            ]
        )
    )
    grid = itertools.product((8, 16, 32), (128, 256), down_tiles, (4, 8))
    return [
        {
            "GATE_UP_BLOCK_N": gate_n,
            "GATE_UP_BLOCK_K": gate_k,
            "DOWN_BLOCK_E": down_e,
            "DOWN_SPLIT": down_split,
            "DOWN_BLOCK_N": down_n,
            "DOWN_BLOCK_K": down_k,
            "num_warps": warps,
            "num_stages": 2,
        }
        for gate_n, gate_k, (down_e, down_split, down_n, down_k), warps in grid
    ]


def paths_for(tokens: int, requested: str | None, fp8: bool) -> list[str]:
    if requested is not None:
        return [requested]
    return [
        p
        for p in PATHS
        if (p != "small" or tokens <= SMALL_PATH_MAX_TOKENS) and not (fp8 and p == "grouped_mm")
    ]


def running_small(args: argparse.Namespace, tokens: int) -> dict[str, int]:
    """The small-path config the layer runs without a sweep: tuned table, else the rule."""
    shape = (args.experts, args.intermediate, args.hidden, args.top_k)
    return moe_configs(tokens, *shape, device_properties(torch.device("cuda")), args.fp8)[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--path", choices=sorted(PATHS), default=None)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--fp8", action="store_true", help="FP8 experts (128x128 block scales)")
    parser.add_argument("--sweep", action="store_true", help="grid of small-path tile configs")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument(
        "--save",
        type=Path,
        default=None,
        help="with --sweep: write each token count's best small config as the 'small' section "
        "of this shape's tuned file in this folder (ferrum/kernels/fused_moe_configs to use it)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_moe_layer needs a CUDA GPU", file=sys.stderr)
        return 1
    token_counts = [int(t) for t in args.tokens.split(",")]
    layers = make_layers(args, max(token_counts))
    if args.fp8 and args.path == "grouped_mm":
        parser.error("--fp8 runs the Triton paths only (small, grouped, auto)")
    # w13 + w2 of one expert
    expert_bytes = 3 * args.hidden * args.intermediate * (1 if args.fp8 else DTYPE.itemsize)
    gen = torch.Generator(device="cuda").manual_seed(1)
    results: list[Result] = []
    best_small: dict[int, dict[str, int]] = {}

    def record(tokens: int, path: str, us: float, active: float, config) -> None:
        gbps = active * expert_bytes / (us * 1e-6) / 1e9
        results.append(Result(tokens, path, us, gbps, active, config))
        label = "" if config is None else f" {config}"
        print(f"{tokens:>6} {path:>8} {us:>10.1f} {gbps:>8.0f} {active:>8.1f}{label}", flush=True)

    print(f"{'tokens':>6} {'path':>8} {'us/layer':>10} {'GB/s':>8} {'experts':>8}")
    for tokens in token_counts:
        hidden = torch.randn(tokens, args.hidden, device="cuda", dtype=DTYPE, generator=gen)
        active = active_experts(layers, tokens, args.top_k)
        for path in paths_for(tokens, args.path, args.fp8):
            limit, config = (
                (None, GROUPED_MM) if path == "grouped_mm" else (PATH_LIMITS[path], None)
            )
            us = time_layer_us(layers, hidden, args.top_k, limit, config, args.replays)
            record(tokens, path, us, active, None)
        if args.sweep and tokens <= SMALL_PATH_MAX_TOKENS:
            best: tuple[float, dict[str, int]] | None = None
            for config in sweep_configs(args.top_k):
                try:
                    us = time_layer_us(
                        layers, hidden, args.top_k, PATH_LIMITS["small"], config, args.replays
                    )
                except Exception as exc:  # a config the compiler rejects (e.g. out of registers)
                    print(f"  skip {config}: {type(exc).__name__}")
                    continue
                record(tokens, "small", us, active, config)
                if best is None or us < best[0]:
                    best = (us, config)
            if best is not None:
                best_small[tokens] = best[1]
                print(
                    f"T={tokens}: best small config {best[1]} {best[0]:.1f} us/layer "
                    f"(as shipped: {running_small(args, tokens)})"
                )
    if args.save is not None and best_small:
        path = save_section(
            args.experts,
            args.intermediate,
            args.hidden,
            torch.cuda.get_device_name(),
            "small",
            best_small,
            args.save,
            fp8=args.fp8,
        )
        print(f"wrote {path}")
    if args.out is not None:
        payload = {
            "device": torch.cuda.get_device_name(),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "results": [asdict(r) for r in results],
        }
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
