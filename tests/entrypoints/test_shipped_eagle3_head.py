"""The shipped EAGLE-3 head (ferrum/model_files/ferrum-tiny-qwen3-eagle3, trained by
tools/train_eagle3_head.py) loads on the shipped model, and greedy output with it equals the
output without speculation while its drafts are accepted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ferrum import LLM, SamplingParams
from ferrum.default_model import DEFAULT_MODEL_DIR

HEAD_DIR = str(Path(DEFAULT_MODEL_DIR).parent / "ferrum-tiny-qwen3-eagle3")


def test_shipped_head_keeps_greedy_output_and_gets_drafts_accepted(
    shipped_llm: Any, one_torch_thread: None
) -> None:
    prompt = "To create a new table,"
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = shipped_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(
        DEFAULT_MODEL_DIR,
        dtype="float32",
        device="cpu",
        num_kv_blocks=64,
        max_model_len=256,
        speculative_config={"method": "eagle3", "model": HEAD_DIR, "num_speculative_tokens": 3},
    )
    try:
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        stats = llm.llm_engine.stats()
    finally:
        llm.shutdown()
    assert list(out) == list(plain)
    assert stats.spec_num_drafts > 0
    assert stats.spec_num_accepted_tokens > 0
