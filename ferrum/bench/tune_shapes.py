"""What `ferrum tune` measures: the op shapes a model runs on one tensor-parallel rank, and the
(op, shape, batch) tasks over them. Ops:
  gemv         the bf16 linear at one row (dense_linear), a shape per weight [N, K];
  gemv_rows    the bf16 linear at 2-16 rows (gemv_rows), per weight and row bucket;
  fp8_gemm     the FP8 linear (fp8_linear, block or per-channel scales) per weight and row count;
  moe_grouped  the fused MoE's grouped GEMMs per token count above the small-batch path's;
  moe_small    its small-batch GEMVs per token count up to SMALL_BATCH_MAX_TOKENS;
  moe_w8a8     its W8A8 grouped GEMMs (FP8 experts) per token count from W8A8_MIN_TOKENS.
Linear shapes are those of the attention and MLP projections as ferrum merges them (qkv, o,
gate_up, down; the LM head for gemv and gemv_rows, which FP8 leaves unquantized);
linear-attention layers' own projections are not listed."""

from __future__ import annotations

from dataclasses import dataclass

from ferrum.bench.tune_args import OPS
from ferrum.kernels.fused_moe_rule import W8A8_MIN_TOKENS
from ferrum.kernels.fused_moe_small_batch import SMALL_BATCH_MAX_TOKENS
from ferrum.kernels.gemv_rows_config import ROW_BUCKETS
from ferrum.model_arch import ModelArchConfig


@dataclass(frozen=True, slots=True)
class LinearShape:
    """A weight [N, K] (out x in features) as one rank holds it."""

    n: int
    k: int

    @property
    def key(self) -> str:
        return f"N{self.n}_K{self.k}"


@dataclass(frozen=True, slots=True)
class MoEShape:
    """Stacked experts as one rank holds them: E experts of intermediate size I, hidden H."""

    num_experts: int
    inter: int
    hidden: int
    top_k: int

    @property
    def key(self) -> str:
        return f"E{self.num_experts}_I{self.inter}_H{self.hidden}_k{self.top_k}"


@dataclass(frozen=True, slots=True)
class TuneTask:
    """One measurement: the best config of `op` for `shape` at `m` rows (tokens)."""

    op: str
    shape: LinearShape | MoEShape
    m: int

    @property
    def key(self) -> str:
        return f"{self.op}:{self.shape.key}:M{self.m}"


def _split(size: int, tp: int, what: str) -> int:
    if size % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide {what} ({size})")
    return size // tp


def model_shapes(arch: ModelArchConfig, tp: int) -> tuple[list[LinearShape], list[MoEShape]]:
    """(linear weights without the LM head, MoE layers) of one of `tp` ranks; the LM head is
    `lm_head_shape`."""
    heads = _split(arch.num_attention_heads, tp, "num_attention_heads")
    kv_heads = max(1, arch.num_kv_heads // tp)  # replicated when fewer than the ranks
    linear = [
        LinearShape((heads + 2 * kv_heads) * arch.head_dim, arch.hidden_size),
        LinearShape(arch.hidden_size, heads * arch.head_dim),
    ]
    moe: list[MoEShape] = []
    dense_mlp = arch.num_experts == 0 or arch.mlp_only_layers or arch.decoder_sparse_step > 1
    inters = [arch.intermediate_size] if dense_mlp else []
    if arch.num_experts:
        inter = _split(arch.moe_intermediate_size, tp, "moe_intermediate_size")
        moe.append(MoEShape(arch.num_experts, inter, arch.hidden_size, arch.num_experts_per_tok))
        if arch.shared_expert_intermediate_size:
            inters.append(arch.shared_expert_intermediate_size)
    for size in inters:
        inter = _split(size, tp, "intermediate_size")
        linear += [LinearShape(2 * inter, arch.hidden_size), LinearShape(arch.hidden_size, inter)]
    return list(dict.fromkeys(linear)), moe


def lm_head_shape(arch: ModelArchConfig, tp: int) -> LinearShape:
    return LinearShape(-(-arch.vocab_size // tp), arch.hidden_size)


def parse_shape(text: str) -> LinearShape | MoEShape:
    """`linear:N:K` or `moe:E:I:H:TOP_K` (the --shape flag)."""
    kind, _, rest = text.partition(":")
    try:
        values = [int(v) for v in rest.split(":")]
    except ValueError:
        values = []
    if kind == "linear" and len(values) == 2 and min(values) > 0:
        return LinearShape(*values)
    if kind == "moe" and len(values) == 4 and min(values) > 0:
        return MoEShape(*values)
    raise ValueError(f"--shape: expected linear:N:K or moe:E:I:H:TOP_K, got {text!r}")


def build_tasks(
    ops: tuple[str, ...],
    linear: list[LinearShape],
    moe: list[MoEShape],
    batch_sizes: tuple[int, ...],
) -> list[TuneTask]:
    """The tasks of each op in `ops`: gemv at one row; gemv_rows at the batch sizes that are
    its row buckets (gemv_rows_config.ROW_BUCKETS); fp8_gemm at every batch size;
    moe_small at those up to SMALL_BATCH_MAX_TOKENS and moe_grouped at those above; moe_w8a8
    at those the rule runs W8A8 (from W8A8_MIN_TOKENS)."""
    tasks: list[TuneTask] = []
    for op in ops:
        if op == "gemv":
            tasks += [TuneTask(op, shape, 1) for shape in linear]
        elif op == "gemv_rows":
            sizes = [m for m in batch_sizes if m in ROW_BUCKETS]
            tasks += [TuneTask(op, s, m) for s in linear for m in sizes]
        elif op == "fp8_gemm":
            tasks += [TuneTask(op, s, m) for s in linear for m in batch_sizes]
        elif op in ("moe_small", "moe_grouped"):
            small = op == "moe_small"
            sizes = [m for m in batch_sizes if (m <= SMALL_BATCH_MAX_TOKENS) == small]
            tasks += [TuneTask(op, s, m) for s in moe for m in sizes]
        elif op == "moe_w8a8":
            sizes = [m for m in batch_sizes if m >= W8A8_MIN_TOKENS]
            tasks += [TuneTask(op, s, m) for s in moe for m in sizes]
        else:
            raise ValueError(f"--ops: unknown op {op!r}; ops are {', '.join(OPS)}")
    return tasks
