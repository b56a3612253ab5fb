"""One rank's engine loop, played by hand: a Scheduler and a ModelRunner over a tiny checkpoint.

Every rank of a tensor-parallel group runs the same deterministic loop (the scheduler depends
only on the requests and the sampled tokens, which every rank samples identically), so each
rank's scheduler produces the same steps without any broadcast, as B's workers will receive
them. `generate` with no group is the tp=1 reference.
"""

from __future__ import annotations

from typing import Any

import torch

from ferrum.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from ferrum.distributed.parallel_state import TensorParallelGroup
from ferrum.engine.draft_model_config import draft_model_config, eagle3_config
from ferrum.kv.kv_cache_manager import KVCacheManager
from ferrum.model_executor.model_runner import ModelRunner
from ferrum.request import Request
from ferrum.sampling_params import SamplingParams
from ferrum.scheduler.scheduler import Scheduler
from ferrum.speculative_config import SpeculativeConfig, num_lookahead_tokens
from tests.utils.tiny_llm import random_prompts

BLOCK_SIZE = 4
# A pool and a token budget small enough that the prompts below are chunked, hit each other's
# cached prefixes and force preemptions.
NUM_KV_BLOCKS = 28
# A sliding-window group (window 6) holds at most 7 blocks per request, so its pool is smaller.
NUM_SLIDING_KV_BLOCKS = 12
MAX_NUM_BATCHED_TOKENS = 16
MAX_TOKENS = 8


def engine_config(
    path: str,
    tp: int = 1,
    cuda: bool = False,
    speculative: dict[str, Any] | None = None,
    **parallel: Any,
) -> EngineConfig:
    """fp32; on the CPU the torch kernels, on CUDA the Triton kernels and CUDA graphs."""
    model = ModelConfig(path, dtype="float32", max_model_len=128)
    device = DeviceConfig(device="cuda", kernel_backend="triton") if cuda else DeviceConfig()
    spec = SpeculativeConfig.from_value(speculative)
    return EngineConfig(
        speculative_config=spec,
        draft_model_config=draft_model_config(spec, model),
        eagle3_config=eagle3_config(spec, model.arch),
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS),
        scheduler_config=SchedulerConfig(
            max_model_len=128, max_num_seqs=8, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS
        ),
        device_config=device,
        parallel_config=ParallelConfig(tensor_parallel_size=tp, **parallel),
    )


def workload(vocab_size: int) -> list[tuple[list[int], SamplingParams]]:
    """Greedy prompts (two pairs share a long prefix) and one seeded sampled request."""
    shared = random_prompts([18], seed=11, vocab=vocab_size)[0]
    tails = random_prompts([3, 9, 1, 6, 13], seed=12, vocab=vocab_size)
    prompts = [shared + tails[0], shared + tails[1], tails[2] + shared, tails[3], tails[4]]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [(p, greedy) for p in prompts] + [(tails[1] + tails[4], seeded)]


@torch.inference_mode()
def generate(
    path: str,
    group: TensorParallelGroup | None = None,
    cuda: bool = False,
    speculative: dict[str, Any] | None = None,
    **parallel: Any,
) -> dict[str, Any]:
    """Runs `workload` to the end: each request's output tokens (seeded last), the scheduler's
    preemptions, prefix-cache hits and accepted drafts. `cuda`: on the current CUDA device,
    graphs captured. `speculative`: a speculative_config."""
    tp = 1 if group is None else group.world_size
    config = engine_config(path, tp, cuda, speculative, **parallel)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    runner = ModelRunner(config, device, group)
    num_blocks = [
        NUM_KV_BLOCKS if group.sliding_window is None else NUM_SLIDING_KV_BLOCKS
        for group in runner.kv_cache_groups
    ]
    runner.initialize_kv_cache(num_blocks)
    runner.capture_cuda_graphs()
    kv = KVCacheManager(
        num_blocks,
        BLOCK_SIZE,
        enable_prefix_caching=True,
        groups=runner.kv_cache_groups,
        max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
    )
    scheduler = Scheduler(
        config.scheduler_config,
        kv,
        num_lookahead_tokens=num_lookahead_tokens(config.speculative_config),
    )
    requests = [
        Request(f"r{i}", prompt, params.resolve())
        for i, (prompt, params) in enumerate(workload(config.model_config.vocab_size))
    ]
    # The first three arrive first; the rest once the first steps ran (prefix hits, preemption).
    for request in requests[:3]:
        scheduler.add_request(request)
    num_steps = 0
    while scheduler.has_unfinished_requests():
        if num_steps == 3:
            for request in requests[3:]:
                scheduler.add_request(request)
        scheduler_output = scheduler.schedule()
        runner_output = runner.complete(runner.launch(scheduler_output))
        scheduler.update_from_output(scheduler_output, runner_output)
        num_steps += 1
    return {
        "tokens": [list(r.output_token_ids) for r in requests],
        "num_preemptions": scheduler.num_preemptions,
        "prefix_cache_hits": kv.prefix_cache_hits,
        "accepted_drafts": scheduler.spec_stats.num_accepted_tokens,
    }


def generate_on_rank(
    group: TensorParallelGroup,
    path: str,
    parallel: dict[str, Any],
    cuda: bool = False,
    speculative: dict[str, Any] | None = None,
) -> Any:
    torch.manual_seed(1000 + group.rank)  # nothing may depend on the global generator
    return generate(path, group, cuda, speculative, **parallel)
