"""FP8 MoE experts end to end on CUDA: W8A8 (the rule's choice for prompt chunks and batches of
16 decodes; the norm before the experts writes their FP8 rows) against the weight-only engine on
the same quantized weights, both with CUDA graphs; eager gives the graphs' tokens."""

from __future__ import annotations

import pytest
import torch

from ferrum import SamplingParams
from ferrum.kernels import fused_moe_rule
from ferrum.kernels.device_properties import device_properties
from tests.utils.tiny_llm import cuda_llm, random_prompts, teacher_forced_agreement

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available()
    or not device_properties(torch.device("cuda")).has_fp8_tensor_cores,
    reason="needs a CUDA GPU with FP8 tensor cores (sm89+)",
)
SHAPES = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "head_dim": 64,
    "moe_intermediate_size": 128,
}


def _experts_block(llm):
    return llm.llm_engine.core.executor.runner.model.model.layers[0].mlp


def _generate(llm, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_w8a8_experts_generate_like_weight_only(tiny_checkpoint, monkeypatch) -> None:
    path = tiny_checkpoint("qwen3_moe", **SHAPES)
    prompts = random_prompts([40, 9, 23, 17] * 4, seed=31)  # 16 decodes a step
    engine = dict(quantization="fp8", dtype="bfloat16", num_kv_blocks=128)
    w8a8 = cuda_llm(path, **engine)
    block = _experts_block(w8a8)
    assert block.takes_fp8_rows(torch.empty(16, 128, device="cuda"))
    assert not block.takes_fp8_rows(torch.empty(8, 128, device="cuda"))  # the GEMV path
    got = _generate(w8a8, prompts)
    assert got == _generate(cuda_llm(path, enforce_eager=True, **engine), prompts)
    # Weight-only everywhere while this engine captures its graphs and runs its steps.
    monkeypatch.setattr(fused_moe_rule, "W8A8_MIN_TOKENS", 1 << 30)
    weight_only = cuda_llm(path, **engine)
    assert not _experts_block(weight_only).takes_fp8_rows(torch.empty(64, 128, device="cuda"))
    # W8A8 rounds each expert input by up to 2^-4 more, and a tiny random model has near-tied
    # logits (tests/hf_equivalence/test_fp8_checkpoints.py): most tokens stay the weight-only
    # engine's choice after the same prefix; a wrong scale or layout agrees at chance level.
    agree = teacher_forced_agreement(weight_only, prompts, got)
    print(f"W8A8 experts: {agree:.0%} of the tokens are the weight-only engine's choice")
    assert agree >= 0.7
