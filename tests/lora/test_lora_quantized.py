"""Adapters on a quantized base: a GPTQ int4 checkpoint (W4A16) with LoRA gives the greedy tokens
of transformers + PEFT on its dequantized twin (the same weights in fp32) with the same adapter."""

from __future__ import annotations

from ferrum import LoRARequest, SamplingParams
from tests.utils.int4_checkpoints import write_int4_checkpoint
from tests.utils.lora_adapters import peft_greedy
from tests.utils.tiny_llm import MAX_TOKENS, make_llm, random_prompts


def test_int4_base_with_adapters_matches_peft_on_its_twin(tiny_checkpoint, peft_adapter, tmp_path):
    int4_dir, twin = write_int4_checkpoint(
        tiny_checkpoint("llama"), str(tmp_path / "int4"), "gptq", 32
    )
    adapter = peft_adapter("llama", rank=4, seed=8)
    prompts = random_prompts([6, 10], seed=21)
    llm = make_llm(int4_dir, enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        params,
        use_tqdm=False,
        lora_request=[LoRARequest("a", 1, adapter), None],
    )
    got = [o.outputs[0].token_ids for o in outputs]
    assert got == [
        peft_greedy(twin, adapter, prompts[:1], MAX_TOKENS)[0],
        peft_greedy(twin, None, prompts[1:], MAX_TOKENS)[0],
    ]
