"""What start-up's passes (`warm_up.py`, `gpu_memory_profile.py`) use of a model runner: they
run forwards and bind caches through these members only, and never import the runner."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ferrum.config import EngineConfig
    from ferrum.kv.kv_cache_spec import KVCacheGroupSpec
    from ferrum.model_executor.input_batch import InputBuffers
    from ferrum.model_executor.pipeline_stage import PipelineStage
    from ferrum.model_executor.sampler import Sampler
    from ferrum.model_executor.speculative.decoder import SpeculativeDecoder
    from ferrum.model_executor.staging_buffer import StagingBuffer


class StartUpRunner(Protocol):
    config: EngineConfig
    device: torch.device
    model: nn.Module
    stage: PipelineStage
    inputs: InputBuffers
    block_size: int
    vocab_size: int
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    kv_cache_dtype: torch.dtype
    tp_size: int
    sampler: Sampler
    sampling_staging: StagingBuffer
    speculative: SpeculativeDecoder | None

    def forward_prompts(self, seq_lens: list[int]) -> torch.Tensor | None: ...
    def initialize_kv_cache(self, num_blocks: int | list[int]) -> None: ...
    def release_kv_cache(self) -> None: ...
    def disable_sdpa_after_prefixes(self) -> None: ...
    def uses_cuda_graphs(self) -> bool: ...
