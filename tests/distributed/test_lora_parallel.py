"""LoRA over worker processes (gloo): under tensor parallelism each rank holds its share of every
adapter (column-parallel layers their rows of B per q/k/v or gate/up shard, row-parallel ones
their input columns of A); under pipeline parallelism each stage its layers' part. Workers get
the adapters' weights with the step that first needs them and give transformers + PEFT's greedy
tokens with adapters and the base model mixed in one batch. The tiny llama has 2 KV heads: each
tensor-parallel rank holds one of k's and v's."""

from __future__ import annotations

import pytest

from ferrum import LoRARequest, SamplingParams
from tests.utils.lora_adapters import peft_greedy
from tests.utils.tiny_llm import MAX_TOKENS, make_llm, random_prompts

PROMPTS = random_prompts([9, 4, 17, 6], seed=9)


@pytest.fixture(scope="module")
def base_and_loras(tiny_checkpoint, peft_adapter) -> tuple[str, list]:
    """The base checkpoint and each prompt's adapter (None: the base model)."""
    a = LoRARequest("a", 1, peft_adapter("llama", rank=4, alpha=8.0, seed=1))
    b = LoRARequest("b", 2, peft_adapter("llama", rank=8, use_rslora=True, seed=7))
    return tiny_checkpoint("llama"), [a, None, b, a]


@pytest.fixture(scope="module")
def expected(base_and_loras) -> list[list[int]]:
    """transformers + PEFT's greedy tokens of each prompt, once for both parallelisms."""
    base, loras = base_and_loras
    return [
        peft_greedy(base, None if lora is None else lora.lora_path, [p], MAX_TOKENS)[0]
        for p, lora in zip(PROMPTS, loras)
    ]


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_two_ranks_give_peft_tokens(base_and_loras, expected, parallel) -> None:
    base, loras = base_and_loras
    llm = make_llm(
        base,
        distributed_executor_backend="mp",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        num_kv_blocks=64,
        max_num_batched_tokens=8,
        num_cpu_threads=1,
        **{parallel: 2},
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False, lora_request=loras
        )
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == expected
