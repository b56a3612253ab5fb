"""`ferrum tune`: finds the fastest kernel tiles of a model's op shapes on this GPU and writes
them where ferrum reads them first (the user's tuned-table folder, kernels/tuned_tables), as
vLLM's `benchmark_moe.py --tune` does for its MoE. The shapes come from a model folder (under
--tensor-parallel-size) or --shape; the ops from --dtype (bf16: gemv, the few-row gemv_rows at
the batches that are its row buckets, moe_grouped, moe_small; fp8: fp8_gemm, moe_small with FP8
experts and their W8A8 GEMMs moe_w8a8, plus the weight-only moe_grouped on a GPU without FP8
tensor cores, where it runs those batches) or --ops; the batches from --batch-sizes. Each (op,
shape, batch) times every candidate of tune_ops' search space (tune_gpu: CUDA graphs, CUDA
events, median; tune_warm's workers compile them first) and keeps the fastest; results are
written as they come (tune_store), so an interrupted run is resumed by running it again."""

from __future__ import annotations

import argparse
from pathlib import Path

# The command's flags only (cli.py imports the run, tune.py, when it runs): building the CLI
# imports neither torch nor triton.
OPS = ("gemv", "gemv_rows", "fp8_gemm", "moe_grouped", "moe_small", "moe_w8a8")
DTYPE_OPS = {"bf16": ("gemv", "gemv_rows", "moe_grouped", "moe_small"), "fp8": OPS[2:]}
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def default_ops(dtype: str, fp8_tensor_cores: bool) -> tuple[str, ...]:
    """--ops' default for --dtype on this GPU. With FP8 tensor cores the FP8 experts' batches
    past the small path run W8A8, so their weight-only grouped GEMMs are not tuned (batch-
    invariant mode still runs them: `--ops moe_grouped` tunes them)."""
    if dtype == "fp8" and fp8_tensor_cores:
        return tuple(op for op in DTYPE_OPS["fp8"] if op != "moe_grouped")
    return DTYPE_OPS[dtype]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="model folder whose shapes to tune")
    parser.add_argument(
        "--shape", action="append", default=[], help="linear:N:K or moe:E:I:H:TOP_K (repeatable)"
    )
    parser.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16", help="weights")
    parser.add_argument(
        "--scale-format", choices=("block", "channel"), default="block",
        help="FP8 linear weight scales (default: block, as --quantization fp8 makes)",
    )  # fmt: skip
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--ops", default=None, help=f"comma list of {', '.join(OPS)}")
    parser.add_argument(
        "--batch-sizes", default=",".join(map(str, DEFAULT_BATCH_SIZES)),
        help="comma list of row (token) counts: each is a table bucket",
    )  # fmt: skip
    parser.add_argument(
        "--tuned-config-dir", type=Path, default=None,
        help="folder to write (default: the one ferrum reads, ~/.cache/ferrum/tuned_configs)",
    )  # fmt: skip
    parser.add_argument("--iters", type=int, default=20, help="calls in a timed CUDA graph")
    parser.add_argument("--repeats", type=int, default=5, help="timed graph replays (median)")
    parser.add_argument(
        "--compile-workers", type=int, default=None,
        help="processes that compile each task's candidates before they are timed (default: "
        "the cores less one, at most 8, as many as half the free GPU memory holds; 0: compile "
        "while timing)",
    )  # fmt: skip
