"""A runner's KV cache memory: the cache's element type, the split-KV decode scratch, and how many
blocks each layer group gets: on the CPU a default budget, on the GPU what is left after one
profiled forward at the largest step (unless kv_cache_memory_bytes sets the budget)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ferrum.config import EngineConfig
from ferrum.kernels import FP8_KV_DTYPE
from ferrum.logger import init_logger
from ferrum.model_executor.cuda_graph import capture_sizes, max_graph_batch_size
from ferrum.model_executor.kv_cache_sizing import (
    cpu_kv_budget,
    group_bytes_per_block,
    num_blocks_from_budget,
)
from ferrum.model_executor.sampling_metadata import SamplingMetadata, SamplingRow
from ferrum.model_executor.speculative.decoder import (
    max_verify_graph_tokens,
)
from ferrum.parallel_config import kv_heads_per_rank
from ferrum.sampling_params import SamplingParams
from ferrum.speculative_config import max_sampled_rows, verify_scratch_slots

if TYPE_CHECKING:
    from ferrum.kernels.paged_attention import SplitKVWorkspace
    from ferrum.model_executor.runner_interface import StartUpRunner

logger = init_logger(__name__)
_GIB = float(1 << 30)


def kv_cache_torch_dtype(
    config: EngineConfig, model_dtype: torch.dtype, kernel_backend: str, device: torch.device
) -> torch.dtype:
    """The model's dtype ("auto") or FP8 e4m3 ("fp8", "fp8_e4m3"), where the layers take it."""
    name = config.cache_config.kv_cache_dtype
    if name == "auto":
        return model_dtype
    if config.model_config.arch.linear_attention_layers:
        raise ValueError(
            f"kv_cache_dtype={name!r}: an FP8 KV cache is not supported yet with "
            f"linear-attention layers ({config.model_config.architecture})"
        )
    if kernel_backend == "triton" and device.type != "cuda":
        raise ValueError(
            f"kv_cache_dtype={name!r}: Triton's CPU interpreter does not convert FP8; use "
            "kernel_backend='torch' on the CPU"
        )
    logger.info("KV cache in %s, per-tensor scales 1.0 (not calibrated)", FP8_KV_DTYPE)
    return FP8_KV_DTYPE


def split_kv_workspace(
    config: EngineConfig, kv_cache_dtype: torch.dtype, tp_size: int, device: torch.device
) -> SplitKVWorkspace:
    """Scratch for the Triton split-KV decode kernel on CUDA, sized once for the whole run."""
    from ferrum.kernels.paged_attention import allocate_split_kv_workspace, split_kv_max_programs

    model_config = config.model_config
    # Batches of at least split_kv_max_programs / num_kv_heads requests take one pass.
    max_programs = split_kv_max_programs(kv_cache_dtype == FP8_KV_DTYPE)
    num_kv_heads = kv_heads_per_rank(model_config.num_kv_heads, tp_size)
    max_num_seqs = min(config.scheduler_config.max_num_seqs, -(-max_programs // num_kv_heads))
    num_heads = model_config.num_attention_heads // tp_size
    return allocate_split_kv_workspace(max_num_seqs, num_heads, model_config.head_dim, device)


def num_kv_blocks(runner: StartUpRunner) -> list[int]:
    """KV blocks per layer group of the runner's pipeline stage."""
    cfg = runner.config
    configs = (cfg.model_config, cfg.cache_config, cfg.scheduler_config, runner.kv_cache_dtype)
    on_cpu = runner.device.type != "cuda"
    layer_ids = runner.stage.layer_ids
    if on_cpu:
        budget = cpu_kv_budget(*configs, runner.tp_size, layer_ids)
    elif cfg.cache_config.kv_cache_memory_bytes is not None:
        budget = cfg.cache_config.kv_cache_memory_bytes
    else:
        budget = profile_gpu_kv_budget(runner)
    if not on_cpu:
        budget -= verify_scratch_bytes(runner)
    # On the CPU an unused default budget would only cost memory; a GPU keeps every block it can
    # for the prefix cache.
    counts = num_blocks_from_budget(
        budget, *configs, cap_to_need=on_cpu, tp_size=runner.tp_size, layer_ids=layer_ids
    )
    spec = runner.speculative
    draft_bytes = (
        0
        if spec is None
        else spec.draft_kv_bytes_per_block(runner.block_size, runner.kv_cache_dtype)
    )
    if draft_bytes and not on_cpu:
        # A draft model's cache takes draft_bytes per block of the first group: the budget
        # shrinks by the share those would take (exact with one group).
        draft_total = counts[0] * draft_bytes
        counts = num_blocks_from_budget(
            budget * budget // (budget + draft_total),
            *configs,
            tp_size=runner.tp_size,
            layer_ids=layer_ids,
        )
    return counts


def base_graph_output_bytes(runner: StartUpRunner) -> int:
    """With LoRA, the outputs the decode graphs without adapters keep (`cuda_graph.py`): one
    [batch, hidden] tensor per captured decode size, (hidden, residual) before the last stage."""
    cfg = runner.config
    if not cfg.lora_config.enable_lora:
        return 0
    sizes = capture_sizes(max_graph_batch_size(cfg.scheduler_config.max_num_seqs))
    per_token = cfg.model_config.arch.hidden_size * getattr(torch, cfg.model_config.dtype).itemsize
    return sum(sizes) * per_token * (1 if runner.stage.is_last else 2)


def verify_scratch_bytes(runner: StartUpRunner) -> int:
    """The verify steps' linear-attention scratch slots (`verify_states.py`), in every layer."""
    cfg = runner.config
    scratch = verify_scratch_slots(
        cfg.scheduler_config.max_num_seqs, cfg.speculative_config, cfg.model_config.arch
    )
    if not scratch:
        return 0
    group = next(g for g in runner.kv_cache_groups if g.recurrent)
    return scratch * group_bytes_per_block(
        cfg.model_config,
        group,
        runner.block_size,
        runner.kv_cache_dtype,
        runner.tp_size,
        runner.stage.layer_ids,
    )


@torch.inference_mode()
def profile_gpu_kv_budget(runner: StartUpRunner) -> int:
    """Runs one forward + sampling at max_num_batched_tokens and measures the peak.

    Budget = total * gpu_memory_utilization - weights - activation peak - CUDA-graph pool
    (estimated as the activations of a forward of the largest graph's tokens: max_num_seqs,
    or more for a verify batch) - non-torch memory.
    """
    sched = runner.config.scheduler_config
    free_before, total = torch.cuda.mem_get_info(runner.device)
    non_torch = (total - free_before) - torch.cuda.memory_reserved(runner.device)
    weights = torch.cuda.memory_allocated(runner.device)
    num_tokens = sched.max_num_batched_tokens
    seq_lens = []
    while sum(seq_lens) < num_tokens:
        seq_lens.append(min(sched.max_model_len, num_tokens - sum(seq_lens)))
    num_blocks = sum(-(-n // runner.block_size) for n in seq_lens) + 1
    # A recurrent group needs one state slot per sequence (+ the padding slot).
    runner.initialize_kv_cache(
        [len(seq_lens) + 1 if g.recurrent else num_blocks for g in runner.kv_cache_groups]
    )
    temp_kv_bytes = torch.cuda.memory_allocated(runner.device) - weights
    torch.cuda.reset_peak_memory_stats(runner.device)
    hidden = runner.forward_prompts(seq_lens)
    logits = None
    if hidden is not None:  # the last stage samples
        # Speculative decoding: verify steps sample a row per draft too.
        num_sampled = min(
            max_sampled_rows(
                runner.config.scheduler_config.max_num_seqs, runner.config.speculative_config
            ),
            num_tokens,
        )
        logits = runner.model.compute_logits(hidden[:num_sampled])
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50).resolve()
        row = SamplingRow(params, [], [], None, set())
        runner.sampler(
            logits,
            SamplingMetadata.from_rows(
                [row] * num_sampled, runner.vocab_size, runner.sampling_staging
            ),
        )
    torch.cuda.synchronize(runner.device)
    activations = torch.cuda.max_memory_allocated(runner.device) - weights - temp_kv_bytes
    runner.release_kv_cache()
    del hidden, logits
    torch.cuda.empty_cache()
    # The largest graph: a decode batch of max_num_seqs or a verify batch of q tokens each.
    graph_tokens = max(sched.max_num_seqs, max_verify_graph_tokens(runner.config))
    graph_pool = (
        int(activations * min(1.0, graph_tokens / num_tokens)) + base_graph_output_bytes(runner)
        if runner.uses_cuda_graphs()
        else 0
    )
    util = runner.config.cache_config.gpu_memory_utilization
    budget = int(total * util) - weights - activations - graph_pool - non_torch
    logger.info(
        "memory: %.2f GiB weights, %.2f GiB activation peak at %d tokens, %.2f GiB for "
        "CUDA graphs, %.2f GiB outside torch; %.2f GiB left for the KV cache",
        weights / _GIB,
        activations / _GIB,
        num_tokens,
        graph_pool / _GIB,
        non_torch / _GIB,
        max(budget, 0) / _GIB,
    )
    if budget <= 0:
        raise ValueError(
            f"the model ({weights / _GIB:.2f} GiB) and a forward of max_num_batched_tokens="
            f"{num_tokens} ({activations / _GIB:.2f} GiB) leave no KV cache room under "
            f"gpu_memory_utilization={util} of {total / _GIB:.1f} GiB: raise "
            "gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return budget
