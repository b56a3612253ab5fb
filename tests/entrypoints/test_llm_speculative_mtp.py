"""Qwen3.5's MTP layer as the proposer (`method: mtp`) on a tiny checkpoint with random `mtp.*`
tensors: greedy tokens equal those without speculation (its drafts are mostly rejected, so the
linear-attention state rolls back every step) under chunked prefill, prefix hits, preemption
and async scheduling; every proposal equals a reference recomputed from scratch with
transformers' layers; checkpoints without the layer are refused naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ferrum import LLM, SamplingParams
from ferrum.errors import FieldError
from tests.utils.mtp_checkpoints import reference_mtp_drafts, with_mtp
from tests.utils.speculation import check_chunks_prefix_hits_and_preemption, record_proposals
from tests.utils.tiny_checkpoints import load_hf_model
from tests.utils.tiny_llm import cuda_llm, make_llm, random_prompts

PROMPTS = random_prompts([9, 17, 26, 13, 5], seed=21)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": 3, "disable_by_batch_size": None}


def generate(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> str:  # noqa: ANN001
    return with_mtp(tiny_checkpoint("qwen3_5"), tmp_path_factory.mktemp("mtp") / "model")


@pytest.fixture(scope="module")
def expected(checkpoint: str) -> list[list[int]]:
    return generate(make_llm(checkpoint))


def test_mtp_drafts_leave_greedy_tokens_unchanged(checkpoint: str, expected) -> None:  # noqa: ANN001
    llm = make_llm(checkpoint, speculative_config=MTP)
    assert generate(llm) == expected
    stats = llm.llm_engine.stats()
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # some are rejected
    assert llm.llm_engine.core.kv_cache_manager.usage == 0.0


def test_a_moe_checkpoints_layer_leaves_greedy_tokens_unchanged(
    tiny_checkpoint,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    """Qwen3.5-MoE: the MTP layer's MLP is routed experts plus a shared expert."""
    path = with_mtp(tiny_checkpoint("qwen3_5_moe"), tmp_path / "moe")
    expected = generate(make_llm(path))
    llm = make_llm(path, speculative_config=MTP)
    assert generate(llm) == expected
    assert llm.llm_engine.stats().spec_num_draft_tokens > 0


def test_chunks_prefix_hits_preemption_and_async_keep_greedy_tokens(
    checkpoint: str,
    expected,  # noqa: ANN001
) -> None:
    check_chunks_prefix_hits_and_preemption(checkpoint, MTP, expected, generate)
    spec = {**MTP, "disable_by_batch_size": 3}
    assert generate(make_llm(checkpoint, speculative_config=spec, async_scheduling=True)) == (
        expected
    )


def test_drafts_equal_a_reference_recomputed_from_scratch(checkpoint: str) -> None:
    """Prompt chunks of 5 and verify steps: every proposal equals the head run over the whole
    sequence (transformers' final hidden states of the target, then a row per draft)."""
    llm = make_llm(checkpoint, speculative_config=MTP, max_num_batched_tokens=5)
    proposals = record_proposals(llm)
    generate(llm)
    hf, tensors = load_hf_model(checkpoint), load_file(f"{checkpoint}/model.safetensors")
    several = [p for p in proposals if len(p[1]) > 1]
    assert len(several) > 5
    for tokens, drafts in several[:6] + [p for p in proposals if len(p[1]) == 1][:2]:
        assert drafts == reference_mtp_drafts(hf, tensors, tokens, len(drafts))


def test_checkpoints_without_the_layer_are_refused(
    tiny_checkpoint,
    checkpoint: str,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    with pytest.raises(FieldError, match="speculative_config.method.*mtp_num_hidden_layers = 0"):
        make_llm(tiny_checkpoint("qwen3_5"), speculative_config=MTP)
    with pytest.raises(FieldError, match="speculative_config.method: 'mtp' runs Qwen3.5's"):
        make_llm(tiny_checkpoint("qwen3"), speculative_config=MTP)
    with pytest.raises(FieldError, match="speculative_config.model: not used by method 'mtp'"):
        make_llm(checkpoint, speculative_config={**MTP, "model": checkpoint})
    # The config names the layer, but its tensors are gone.
    stripped = with_mtp(tiny_checkpoint("qwen3_5"), tmp_path / "stripped")
    tensors = load_file(f"{stripped}/model.safetensors")
    kept = {n: t for n, t in tensors.items() if n != "mtp.fc.weight"}
    save_file(kept, f"{stripped}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(FieldError, match=r"speculative_config.method: 'mtp'.*\['fc.weight'\]"):
        make_llm(stripped, speculative_config=MTP)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_cuda_graphs_keep_greedy_tokens(checkpoint: str, enforce_eager: bool) -> None:
    """The head's pass and decode graphs over the target's verify graphs, async scheduling."""
    kwargs = dict(enforce_eager=enforce_eager, kv_cache_memory_bytes=1 << 30)
    expected = generate(cuda_llm(checkpoint, **kwargs))
    llm = cuda_llm(checkpoint, speculative_config=MTP, **kwargs)
    assert generate(llm) == expected
    assert llm.llm_engine.stats().spec_num_draft_tokens > 0
