"""Where long prompts' time goes: attention against GEMMs against everything else.

Runs --num-prompts prompts of --input-len tokens (default one, 1 output token; `--num-prompts 32
--input-len 4000 --output-len 128` is the `long` workload, decode steps included) twice
untimed, then once under the torch profiler, and sums the CUDA kernels into attention (ferrum's
paged kernels, SDPA's cuDNN / flash ones), GEMMs (cuBLAS / cuBLASLt / nvjet / the GEMV and MoE
GEMMs) and the rest (the MoE router, align and combine among it); prints the shares, the wall
time and the top kernels. The kernels' sum against the profiled wall time says how long the GPU
idled (the profiler slows the host, so that wall is longer than the unprofiled ones). Usage: python
benchmarks/profile_prefill.py --model benchmarks/models/qwen3-8b --input-len 8000
--max-model-len 10240 [engine flags]
"""

# ruff: noqa: E402
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.dummy_engine import engine_parser, make_llm
from ferrum.bench import workloads
from ferrum.sampling_params import SamplingParams

# Driver-side rows the profiler reports with a device time; not kernels.
NOT_KERNELS = {"Command Buffer Full", "cuLaunchKernel", "cuLaunchKernelEx"}
GEMM_MARKERS = ("gemm", "nvjet", "cutlass", "gemv", "sm90_xmma", "matmul")
# ferrum's paged kernels, SDPA's cuDNN ("..._sdpa_..._flash_fprop") and flash ("flash_fwd") ones.
ATTENTION_MARKERS = ("attention", "sdpa", "flash", "fmha")


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    if any(marker in name for marker in ATTENTION_MARKERS):
        return "attention"
    if any(marker in name for marker in GEMM_MARKERS):
        return "gemm"
    return "other"


def main() -> int:
    parser = engine_parser(__doc__.splitlines()[0])
    parser.set_defaults(input_len=8000, num_prompts=1)
    parser.add_argument("--output-len", type=int, default=1)
    args = parser.parse_args()
    llm = make_llm(args)
    vocab = llm.llm_engine.config.model_config.vocab_size
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    def prefill(seed: int) -> float:
        seeds = range(seed * args.num_prompts, (seed + 1) * args.num_prompts)
        prompts = [workloads.lat_prompt(s, args.input_len) for s in seeds]
        start = time.perf_counter()
        llm.generate(
            [{"prompt_token_ids": p} for p in workloads.fold_to_vocab(prompts, vocab)],
            params,
            use_tqdm=False,
        )
        return time.perf_counter() - start

    walls = [prefill(seed) for seed in (1, 2)]  # distinct prompts: no prefix-cache hit
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        walls.append(prefill(3))
    totals: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        us = event.self_device_time_total
        if (
            us <= 0
            or event.key in NOT_KERNELS
            or event.key.startswith(("Memcpy", "Memset", "aten::", "cuda"))
        ):
            continue
        totals[kind_of(event.key)] += us
        per_kernel[event.key] += us
    device_ms = sum(totals.values()) / 1e3
    print(
        f"{args.num_prompts} x {args.input_len}-token prompts, {args.output_len} tokens out: "
        f"wall {[round(w * 1e3, 1) for w in walls]} ms (the last profiled)"
    )
    kinds = sorted(totals.items())
    shares = [f"{kind} {us / 1e3:.1f} ms ({us / 1e3 / device_ms:.0%})" for kind, us in kinds]
    print(f"kernels {device_ms:.1f} ms: " + ", ".join(shares))
    for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {us / 1e3:8.2f} ms  {kind_of(name):9s} {name[:90]}")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
