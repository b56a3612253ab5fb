"""Speculative decoding on a hybrid model (Qwen3.5: gated DeltaNet + full attention): greedy
tokens equal those without speculation with n-gram drafts on copy-heavy prompts, a draft model
and replayed drafts at acceptance 0.5 and 0 (rejections every step, so the linear-attention
state must roll back to the last accepted token), under chunked prefill, prefix hits on state
snapshots, preemption and async scheduling; the Triton kernels under the interpreter (CPU only)
and the verify CUDA graphs (CUDA only); EAGLE-3 is refused for such a model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ferrum import SamplingParams
from ferrum.errors import FieldError
from tests.utils.eagle3_heads import head_config, random_head_tensors, write_head
from tests.utils.speculation import (
    NGRAM,
    PROMPTS,
    accepted_fraction,
    check_chunks_prefix_hits_and_preemption,
    generate,
    replay_config,
)
from tests.utils.tiny_llm import cuda_llm, make_llm


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> str:  # noqa: ANN001
    return tiny_checkpoint("qwen3_5")


@pytest.fixture(scope="module")
def expected(checkpoint: str) -> list[list[int]]:
    return generate(make_llm(checkpoint))


def test_ngram_drafts_leave_greedy_tokens_unchanged(checkpoint: str, expected) -> None:  # noqa: ANN001
    llm = make_llm(checkpoint, speculative_config=NGRAM)
    assert generate(llm) == expected
    assert llm.llm_engine.stats().spec_num_drafts > 0


def test_a_draft_model_leaves_greedy_tokens_unchanged(
    checkpoint: str,
    expected,
    tiny_checkpoint,  # noqa: ANN001
) -> None:
    """A tiny Qwen3 of the same vocabulary drafts (mostly rejected: another model)."""
    spec = {"method": "draft_model", "model": tiny_checkpoint("qwen3"), "num_speculative_tokens": 2,
            "disable_by_batch_size": None}  # fmt: skip
    llm = make_llm(checkpoint, speculative_config=spec)
    assert generate(llm) == expected
    assert accepted_fraction(llm) < 1.0


@pytest.mark.parametrize("rate", [0.5, 0.0])
def test_rejected_drafts_roll_the_state_back(
    checkpoint: str,
    expected,
    rate: float,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    llm = make_llm(
        checkpoint, speculative_config=replay_config(tmp_path / "c.json", expected, rate)
    )
    assert generate(llm) == expected
    accepted = accepted_fraction(llm)
    assert 0.1 < accepted < 0.9 if rate else accepted == 0.0
    assert llm.llm_engine.core.kv_cache_manager.usage == 0.0


def test_chunks_prefix_hits_and_preemption_keep_greedy_tokens(
    checkpoint: str,
    expected,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    """Chunks, prefix hits on state snapshots and preemption, drafts accepted half the time."""
    spec = replay_config(tmp_path / "c.json", expected, 0.5)
    check_chunks_prefix_hits_and_preemption(checkpoint, spec, expected)


def test_async_scheduling_keeps_greedy_tokens(
    checkpoint: str,
    expected,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    """Steps run ahead while more requests run than speculate (disable_by_batch_size 3)."""
    spec = {**replay_config(tmp_path / "c.json", expected, 0.5), "disable_by_batch_size": 3}
    llm = make_llm(checkpoint, speculative_config=spec, async_scheduling=True)
    lengths = [20, 4, 9, 14, 17]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [e[:n] for e, n in zip(expected, lengths)]
    assert llm.llm_engine.stats().spec_num_drafts > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton CPU interpreter: CUDA runs below")
def test_triton_kernels_roll_the_state_back(checkpoint: str, expected, tmp_path: Path) -> None:  # noqa: ANN001
    """Two prompts, 8 tokens each (the interpreter is slow): verify rows beside a decode."""
    pytest.importorskip("triton")
    spec = replay_config(tmp_path / "c.json", expected, 0.5)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = make_llm(checkpoint, speculative_config=spec, kernel_backend="triton")
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [e[:8] for e in expected[:2]]
    assert 0.0 < accepted_fraction(llm) < 1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_cuda_verify_graphs_roll_the_state_back(
    checkpoint: str,
    tmp_path: Path,
    enforce_eager: bool,  # noqa: ANN001
) -> None:
    kwargs = dict(enforce_eager=enforce_eager, kv_cache_memory_bytes=1 << 30)
    expected = generate(cuda_llm(checkpoint, **kwargs))
    for spec in (NGRAM, replay_config(tmp_path / "c.json", expected, 0.5)):
        llm = cuda_llm(checkpoint, speculative_config=spec, **kwargs)
        assert generate(llm) == expected
        assert generate(llm, PROMPTS[:1]) == expected[:1]  # batch 1
    assert 0.1 < accepted_fraction(llm) < 0.9


def test_eagle3_is_refused(checkpoint: str, tmp_path: Path) -> None:
    config = head_config()
    head = write_head(tmp_path, config, random_head_tensors(config, 1))
    spec = {"method": "eagle3", "num_speculative_tokens": 2, "model": head}
    with pytest.raises(FieldError, match="eagle3 needs a target in .*got Qwen3_5ForCausalLM"):
        make_llm(checkpoint, speculative_config=spec)
