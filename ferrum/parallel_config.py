"""How one model is spread over the devices: tensor, expert and data parallelism, the executor
backend, and the checks that a model splits exactly."""

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
    """How one model is spread over the devices of one host: data_parallel_size replicas of
    tensor_parallel_size ranks each (replica i on devices i * tp ... i * tp + tp - 1). Construction resolves
    distributed_executor_backend None: "uni" (in process) for one rank, "mp" (one process per
    rank) for more."""

    tensor_parallel_size: int = field(
        default=1, metadata=_help("ranks (GPUs) each layer's weights are split over")
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
            "tensor_parallel_size GPUs; requests go to the least loaded"
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
            backend = "uni" if tp == 1 else "mp"
        if backend not in EXECUTOR_BACKENDS:
            raise _fail(
                "distributed_executor_backend",
                f"must be one of {EXECUTOR_BACKENDS} or None, got {backend!r}",
            )
        if backend == "uni" and tp > 1:
            raise _fail(
                "distributed_executor_backend",
                f"'uni' runs one rank; tensor_parallel_size={tp} needs 'mp' or 'ray'",
            )
        if backend == "ray" and dp > 1:
            raise _fail(
                "distributed_executor_backend",
                f"'ray' with data_parallel_size={dp} is not supported (replicas run on this "
                "node only, with 'mp' or 'uni')",
            )
        object.__setattr__(self, "distributed_executor_backend", backend)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads each rank holds: an equal split, or one (replicated) when there are fewer KV
    heads than ranks."""
    return max(1, num_kv_heads // tensor_parallel_size)


def check_parallel_fits_model(parallel: ParallelConfig, arch: ModelArchConfig) -> None:
    """Every split the parallel layers make must be exact: attention heads, KV heads (split,
    or replicated when tensor_parallel_size is a multiple of them), MLP widths and experts."""
    tp = parallel.tensor_parallel_size
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
