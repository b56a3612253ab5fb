"""Speculative decoding on the GPU (runs only with CUDA): greedy tokens equal those without
speculation through the verify CUDA graphs (batches of 1..15 requests) and eagerly, at several
acceptance rates; at a real model's shapes (Qwen3-0.6B, random bf16 weights) in batch-invariant
mode, where the verify rows' numerics equal a decode's, bitwise, with replayed drafts and with
the model as its own draft model (all accepted); EAGLE-3 heads through the head's graphs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ferrum import LLM, SamplingParams
from tests.utils.tiny_llm import cuda_llm, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MODELS = Path(__file__).resolve().parents[2] / "benchmarks" / "models"
PROMPTS = [p + p[:9] for p in random_prompts([12, 40, 25, 70, 9, 33, 51], seed=5)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def generate(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def replay(path: Path, prompts: list[list[int]], expected: list[list[int]], rate: float) -> dict:
    path.write_text(json.dumps({",".join(map(str, p)): e for p, e in zip(prompts, expected)}))
    return {"method": "replay", "num_speculative_tokens": 3, "model": str(path),
            "acceptance_rate": rate}  # fmt: skip


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_greedy_tokens_equal_those_without_speculation(
    tiny_checkpoint,
    tmp_path: Path,
    enforce_eager: bool,  # noqa: ANN001
) -> None:
    path = tiny_checkpoint("qwen3")
    # A small KV pool each: several engines share the GPU.
    kwargs = dict(enforce_eager=enforce_eager, kv_cache_memory_bytes=1 << 30)
    expected = generate(cuda_llm(path, **kwargs))
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    llm = cuda_llm(path, speculative_config=ngram, **kwargs)
    assert generate(llm) == expected
    assert llm.llm_engine.stats().spec_num_drafts > 0
    for rate in (1.0, 0.6, 0.0):
        spec = replay(tmp_path / "c.json", PROMPTS, expected, rate)
        llm = cuda_llm(path, speculative_config=spec, **kwargs)
        assert generate(llm) == expected
        assert generate(llm, PROMPTS[:1]) == expected[:1]  # batch 1


def test_real_shapes_in_batch_invariant_mode_are_bitwise_equal(tmp_path: Path) -> None:
    kwargs = dict(
        load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048,
        batch_invariant=True, max_num_seqs=32, kv_cache_memory_bytes=4 << 30,
    )  # fmt: skip
    model = str(MODELS / "qwen3-0.6b")
    prompts = [[t + 1000 for t in p] for p in PROMPTS]
    expected = generate(LLM(model, **kwargs), prompts)
    spec = replay(tmp_path / "c.json", prompts, expected, 0.7)
    llm = LLM(model, speculative_config=spec, **kwargs)
    assert generate(llm, prompts) == expected
    stats = llm.llm_engine.stats()
    # Three drafts accepted with probability 0.7 each, until the first refusal.
    assert 0.4 < stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens < 0.65
    draft = {"method": "draft_model", "num_speculative_tokens": 3, "model": model}
    llm = LLM(model, speculative_config=draft, **kwargs)  # its own draft: all accepted
    assert generate(llm, prompts) == expected
    stats = llm.llm_engine.stats()
    assert stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens > 0.95


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_eagle3_heads_through_cuda_graphs(tiny_checkpoint, tmp_path: Path, enforce_eager) -> None:  # noqa: ANN001
    """A random head: greedy tokens unchanged (the pass and decode graphs, batches of 1..7); a
    head that proposes the target's continuation (tests/utils/eagle3_heads.py): every first
    draft accepted, so the graphs read the right rows, tokens and d2t."""
    from tests.utils.eagle3_heads import (
        head_config,
        random_head_tensors,
        successor_head_tensors,
        write_head,
        write_successor_target,
    )

    kwargs = dict(enforce_eager=enforce_eager, kv_cache_memory_bytes=1 << 30)
    target = tiny_checkpoint("qwen3", num_hidden_layers=4)
    config = head_config()
    head = write_head(tmp_path / "random", config, random_head_tensors(config, 1))
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    expected = generate(cuda_llm(target, **kwargs))
    llm = cuda_llm(target, speculative_config=spec, **kwargs)
    assert generate(llm) == expected
    assert generate(llm, PROMPTS[:1]) == expected[:1]
    successor = write_successor_target(tiny_checkpoint("qwen3"), tmp_path / "successor")
    config = head_config(draft_vocab_size=384, eagle_aux_hidden_state_layer_ids=[1, 0, 1])
    head = write_head(tmp_path / "head", config, successor_head_tensors(successor, config))
    expected = generate(cuda_llm(successor, **kwargs))
    llm = cuda_llm(successor, speculative_config={**spec, "model": head}, **kwargs)
    assert generate(llm) == expected
    stats = llm.llm_engine.stats()
    assert stats.spec_num_drafts > 0
    assert stats.spec_accepted_per_position[0] == stats.spec_num_drafts
