"""Times the MoE expert layer (router + fused experts) per token count in four forms: bf16 experts,
FP8 experts weight-only (bf16 activations), FP8 experts W8A8 quantizing the hidden rows in the
launcher, and W8A8 on rows quantized beforehand (`w8a8_rows`: the engine's case, where the norm
before writes them). Each form runs the launcher's default tiles (tuned table, else the rule)
and path for its token count, W8A8 and weight-only forced (`fp8_activations`); `auto` in the
table says which of the two the rule picks. Qwen3-30B-A3B's expert shapes by default.

As bench_moe_layer: `--layers` distinct weight sets (each with its own router logits) run in
sequence in one CUDA graph, so that experts stream from HBM rather than L2; the median replay
time over `--replays` divided by the layers is the per-layer time. The FP8 experts are the bf16
ones quantized (128x128 blocks). `err` is the relative Frobenius distance of a form's output
from bf16's on the first layer.

Usage: python benchmarks/bench_moe_w8a8.py [--tokens 1,16,64,256,2048,8192] [--out results.json]
"""

# ruff: noqa: E402
import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.bench_moe_layer import quantize_experts, random_layer_weights
from benchmarks.gpu_timing import graph_replay_ms
from ferrum.kernels.device_properties import device_properties
from ferrum.kernels.fp8_quant import Fp8GroupRows, per_token_group_quant_fp8
from ferrum.kernels.fused_moe import fused_moe
from ferrum.kernels.fused_moe_rule import uses_fp8_activations
from ferrum.kernels.moe_router import moe_router

DTYPE = torch.bfloat16
FORMS = ("bf16", "weight_only", "w8a8", "w8a8_rows")
WARMUP_REPLAYS = 5


def make_layers(args: argparse.Namespace, max_tokens: int) -> list[dict[str, torch.Tensor]]:
    layers = []
    for w13, w2, logits in random_layer_weights(args, max_tokens):
        (q13, s13), (q2, s2) = quantize_experts(w13), quantize_experts(w2)
        layers.append(dict(w13=w13, w2=w2, logits=logits, q13=q13, s13=s13, q2=q2, s2=s2))
    return layers


def layer_fn(form: str, hidden: torch.Tensor, top_k: int) -> Callable[[dict], torch.Tensor]:
    """One layer of `form` on hidden: the router, then the experts."""
    rows = Fp8GroupRows(*per_token_group_quant_fp8(hidden)) if form == "w8a8_rows" else None

    def run(layer: dict[str, torch.Tensor]) -> torch.Tensor:
        weights, ids = moe_router(layer["logits"][: hidden.shape[0]], top_k, True)
        if form == "bf16":
            return fused_moe(hidden, layer["w13"], layer["w2"], weights, ids)
        return fused_moe(
            hidden, layer["q13"], layer["q2"], weights, ids, w13_scale=layer["s13"],
            w2_scale=layer["s2"], fp8_activations=form != "weight_only", x_fp8=rows,
        )  # fmt: skip

    return run


def time_us(run: Callable[[dict], torch.Tensor], layers: list[dict], replays: int) -> float:
    """Median per-layer microseconds of a graph replay running every layer in sequence."""
    return (
        graph_replay_ms(lambda: [run(layer) for layer in layers], replays, WARMUP_REPLAYS)
        * 1e3
        / len(layers)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,16,64,256,2048,8192")
    parser.add_argument("--forms", default=",".join(FORMS), help=f"comma list of {FORMS}")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_moe_w8a8 needs a CUDA GPU", file=sys.stderr)
        return 1
    forms = args.forms.split(",")
    if not set(forms) <= set(FORMS):
        parser.error(f"--forms: choose from {FORMS}, got {forms}")
    token_counts = [int(t) for t in args.tokens.split(",")]
    layers = make_layers(args, max(token_counts))
    device = device_properties(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(1)
    results = []
    print(f"{device.name}: per layer, microseconds (err: relative to bf16's output)")
    print(f"{'tokens':>6} {'auto':>11} " + " ".join(f"{f:>20}" for f in forms))
    for tokens in token_counts:
        hidden = torch.randn(tokens, args.hidden, device="cuda", dtype=DTYPE, generator=gen)
        auto = "w8a8" if uses_fp8_activations(tokens, device) else "weight_only"
        bf16_out = layer_fn("bf16", hidden, args.top_k)(layers[0]).float()
        cells = []
        for form in forms:
            run = layer_fn(form, hidden, args.top_k)
            err = ((run(layers[0]).float() - bf16_out).norm() / bf16_out.norm()).item()
            us = time_us(run, layers, args.replays)
            results.append({"tokens": tokens, "form": form, "us_per_layer": us, "err": err})
            cells.append(f"{us:>10.1f} (err {err:.3f})")
        print(f"{tokens:>6} {auto:>11} " + " ".join(f"{c:>20}" for c in cells), flush=True)
    if args.out is not None:
        payload = {"device": device.name, "args": vars(args) | {"out": str(args.out)},
                   "results": results}  # fmt: skip
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
