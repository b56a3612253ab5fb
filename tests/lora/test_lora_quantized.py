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


def test_fp8_base_with_adapters(tiny_checkpoint, tmp_path):
    """Block-FP8 (W8A8) base: a base-model request beside an adapter's gives the plain FP8
    engine's tokens (its layers quantize their input themselves, bit-equal to the norms' FP8
    rows), and the adapter's request PEFT's tokens on the dequantized twin (activation rounding
    aside: this adapter's logits are far apart)."""
    from tests.utils.fp8_checkpoints import write_dequantized_twin, write_fp8_checkpoint
    from tests.utils.lora_adapters import make_peft_adapter

    shapes = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 64}
    source = tiny_checkpoint("qwen3", num_key_value_heads=4, **shapes)
    fp8 = write_fp8_checkpoint(source, str(tmp_path / "fp8"), "fp8")
    twin = write_dequantized_twin(fp8, str(tmp_path / "twin"))
    adapter = make_peft_adapter(source, tmp_path / "adapter", rank=4, seed=3)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([9, 5], seed=4)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = make_llm(fp8, num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    lora = make_llm(fp8, enable_lora=True, num_kv_blocks=64).generate(
        prompts, params, use_tqdm=False, lora_request=[LoRARequest("a", 1, adapter), None]
    )
    assert lora[1].outputs[0].token_ids == plain[1].outputs[0].token_ids
    assert (
        lora[0].outputs[0].token_ids
        == peft_greedy(twin, adapter, [prompts[0]["prompt_token_ids"]], 8)[0]
    )
