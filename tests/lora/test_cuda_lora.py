"""LoRA on a GPU (skipped without CUDA): Triton shrink/expand compiled, CUDA graphs captured
with the LoRA layers inside, decode batches replaying them with any mix of adapters; greedy
tokens equal transformers + PEFT's (fp32)."""

from __future__ import annotations

import pytest
import torch

from ferrum import LoRARequest, SamplingParams
from tests.utils.lora_adapters import peft_greedy
from tests.utils.tiny_llm import MAX_TOKENS, cuda_llm, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_graphs_with_adapters_match_peft(tiny_checkpoint, peft_adapter, arch) -> None:
    base = tiny_checkpoint(arch)
    a = LoRARequest("a", 1, peft_adapter(arch, rank=4, seed=1))
    b = LoRARequest("b", 2, peft_adapter(arch, rank=8, seed=2, targets=("q_proj", "up_proj")))
    prompts = random_prompts([5, 40, 2, 19, 33, 7], seed=21)
    loras = [a, None, b, a, b, None]
    llm = cuda_llm(base, enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64)
    runner = llm.llm_engine.core.executor.runner
    assert runner.cuda_graphs is not None and runner.lora.batch.segments is not None
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(2):  # the second round: adapters already in their slots, prefix hits
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
        )
        expected = [
            peft_greedy(base, None if lora is None else lora.lora_path, [p], MAX_TOKENS)[0]
            for p, lora in zip(prompts, loras)
        ]
        assert [o.outputs[0].token_ids for o in outputs] == expected
