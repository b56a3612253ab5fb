"""kernel_backend="triton": every Triton kernel on the CPU (interpreter), still equal to HF."""

from __future__ import annotations

import pytest

from ferrum import SamplingParams
from tests.engine.test_hf_equivalence import MAX_TOKENS, greedy, make_llm, random_prompts
from tests.tiny_checkpoints import hf_greedy

pytest.importorskip("triton")


@pytest.mark.parametrize("arch", ["llama3", "qwen3", "qwen3_moe"])
def test_triton_kernels_match_hf(tiny_checkpoint, arch: str) -> None:
    path = tiny_checkpoint(arch)
    prompts = random_prompts([6, 13, 2], seed=11)
    # Chunked prefill + prefix hits + decodes all go through the Triton kernels.
    llm = make_llm(path, kernel_backend="triton", num_kv_blocks=64, max_num_batched_tokens=9)
    assert llm.llm_engine.core.runner.kernel_backend == "triton"
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    assert greedy(llm, prompts) == expected
    assert greedy(llm, prompts[:1]) == expected[:1]  # served from the prefix cache


def test_auto_backend_is_torch_on_cpu(tiny_checkpoint) -> None:
    llm = make_llm(tiny_checkpoint("qwen3"), num_kv_blocks=16)
    assert llm.llm_engine.core.runner.kernel_backend == "torch"
    out = llm.generate(
        {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 2
