"""How one model is spread over the devices: tensor, pipeline, expert and data parallelism, the
executor backend, and the checks that a model splits exactly."""

from __future__ import annotations

from dataclasses import dataclass, field

from ferrum.config_fields import field_error as _fail
from ferrum.config_fields import field_help as _help
from ferrum.model_arch import ModelArchConfig

EXECUTOR_BACKENDS = ("uni", "mp", "ray")
# Engine cores one front end drives (one node's GPUs, or CPU processes in tests).
MAX_DATA_PARALLEL_SIZE = 64


@dataclass(frozen=True)
class ParallelConfig:
    """How one model is spread over the devices: data_parallel_size replicas of world_size =
    pipeline_parallel_size * tensor_parallel_size ranks each (replica i on devices i * world_size
    ... (i + 1) * world_size - 1 of its host with "mp"; on the GPUs Ray gives it, on any node,
    with "ray"). Rank r is tensor-parallel rank
    r % tensor_parallel_size of pipeline stage r // tensor_parallel_size. Construction resolves
    distributed_executor_backend None: "uni" (in process) for one rank, "mp" (one process per
    rank) for more."""

    tensor_parallel_size: int = field(
        default=1, metadata=_help("ranks (GPUs) each layer's weights are split over")
    )
    pipeline_parallel_size: int = field(
        default=1,
        metadata=_help(
            "pipeline stages the decoder layers are split over, each on its own "
            "tensor_parallel_size ranks; that many batches are in flight at once"
        ),
    )
    enable_expert_parallel: bool = field(
        default=False,
        metadata=_help(
            "MoE models: give each rank whole experts (num_experts / tensor_parallel_size of "
            "them) instead of a slice of every expert"
        ),
    )
    data_parallel_size: int = field(
        default=1,
        metadata=_help(
            "engine cores (replicas) behind one front end, each with its own "
            "tensor_parallel_size x pipeline_parallel_size GPUs (on this node with mp, on any "
            "node of the Ray cluster with ray); requests go to the least loaded"
        ),
    )
    distributed_executor_backend: str | None = field(
        default=None,
        metadata=_help(
            "uni (one process), mp (one worker process per rank) or ray (one Ray actor per "
            "rank, on a Ray cluster: pip install 'ferrum[ray]'); default: uni for "
            "tensor_parallel_size 1, mp above",
            choices=EXECUTOR_BACKENDS,
        ),
    )
    worker_step_timeout: float = field(
        default=300.0,
        metadata=_help(
            "seconds the engine core waits for a step's result from its worker processes; past "
            "it a worker counts as hung, every worker is killed and the step fails"
        ),
    )
    disable_custom_all_reduce: bool = field(
        default=False,
        metadata=_help(
            "send every all-reduce through NCCL instead of sending small bf16 ones through "
            "torch symmetric memory (faster on NVLink)"
        ),
    )

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise _fail("tensor_parallel_size", f"must be an integer >= 1, got {tp!r}")
        pp = self.pipeline_parallel_size
        if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
            raise _fail("pipeline_parallel_size", f"must be an integer >= 1, got {pp!r}")
        dp = self.data_parallel_size
        if not isinstance(dp, int) or isinstance(dp, bool) or not 1 <= dp <= MAX_DATA_PARALLEL_SIZE:
            raise _fail(
                "data_parallel_size",
                f"must be an integer in [1, {MAX_DATA_PARALLEL_SIZE}], got {dp!r}",
            )
        timeout = self.worker_step_timeout
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise _fail("worker_step_timeout", f"must be a number of seconds > 0, got {timeout!r}")
        backend = self.distributed_executor_backend
        if backend is None:
            backend = "uni" if tp * pp == 1 else "mp"
        if backend not in EXECUTOR_BACKENDS:
            raise _fail(
                "distributed_executor_backend",
                f"must be one of {EXECUTOR_BACKENDS} or None, got {backend!r}",
            )
        if backend == "uni" and tp * pp > 1:
            raise _fail(
                "distributed_executor_backend",
                f"'uni' runs one rank; tensor_parallel_size={tp} x pipeline_parallel_size={pp} "
                "needs 'mp' or 'ray'",
            )
        object.__setattr__(self, "distributed_executor_backend", backend)

    @property
    def world_size(self) -> int:
        """Ranks of one replica: every pipeline stage's tensor-parallel ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def output_rank(self) -> int:
        """The rank whose step results (tokens, logprobs) the engine core reads: the last
        pipeline stage's first tensor-parallel rank (rank 0 without a pipeline)."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads each rank holds: an equal split, or one (replicated) when there are fewer KV
    heads than ranks."""
    return max(1, num_kv_heads // tensor_parallel_size)


def check_parallel_fits_model(parallel: ParallelConfig, arch: ModelArchConfig) -> None:
    """Every split the parallel layers make must be exact: attention heads, KV heads (split,
    or replicated when tensor_parallel_size is a multiple of them), MLP widths and experts."""
    tp = parallel.tensor_parallel_size
    pp = parallel.pipeline_parallel_size
    if pp > arch.num_hidden_layers:
        raise _fail(
            "pipeline_parallel_size",
            f"{pp} stages need at least as many decoder layers, the model has "
            f"{arch.num_hidden_layers}",
        )
    if arch.num_attention_heads % tp:
        raise _fail(
            "tensor_parallel_size",
            f"{tp} must divide num_attention_heads={arch.num_attention_heads}",
        )
    kv = arch.num_kv_heads
    if kv % tp and tp % kv:
        raise _fail(
            "tensor_parallel_size",
            f"{tp} must divide num_key_value_heads={kv} or be a multiple of it",
        )
    moe = arch.num_experts > 0
    if parallel.enable_expert_parallel and not moe:
        raise _fail("enable_expert_parallel", f"{arch.architecture} has no experts (num_experts=0)")
    has_dense_mlp = not moe or any(
        (i + 1) % arch.decoder_sparse_step or i in arch.mlp_only_layers
        for i in range(arch.num_hidden_layers)
    )
    if has_dense_mlp and arch.intermediate_size % tp:
        raise _fail(
            "tensor_parallel_size", f"{tp} must divide intermediate_size={arch.intermediate_size}"
        )
    if not moe:
        return
    if parallel.enable_expert_parallel:
        if arch.num_experts % tp:
            raise _fail(
                "tensor_parallel_size",
                f"{tp} must divide num_experts={arch.num_experts} with enable_expert_parallel",
            )
    elif arch.moe_intermediate_size % tp:
        raise _fail(
            "tensor_parallel_size",
            f"{tp} must divide moe_intermediate_size={arch.moe_intermediate_size} (or set "
            "enable_expert_parallel to split whole experts)",
        )
