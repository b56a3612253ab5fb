"""The kernel backend the engine picks. (Triton kernels against HF: tests/hf_equivalence.)"""

from __future__ import annotations

from ferrum import SamplingParams
from tests.utils.tiny_llm import make_llm


def test_auto_backend_is_torch_on_cpu(tiny_checkpoint) -> None:
    llm = make_llm(tiny_checkpoint("qwen3"), num_kv_blocks=16)
    assert llm.llm_engine.core.executor.runner.kernel_backend == "torch"
    out = llm.generate(
        {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 2
