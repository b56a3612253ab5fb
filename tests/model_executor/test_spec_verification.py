"""Drafts verified by sampling: each request's rows expand with its drafts as further outputs,
and a request emits its draws up to and including the first that differs from its draft."""

from __future__ import annotations

from ferrum.model_executor.sampling_metadata import SamplingRow
from ferrum.model_executor.speculative.verification import (
    accept,
    drafts_in_tokens,
    expand_rows,
)
from ferrum.request import Logprobs
from ferrum.sampling_params import SamplingParams


def test_each_request_emits_its_accepted_drafts_then_one_draw() -> None:
    drafts = [[5, 6, 7], [], [8, 9]]
    # Rows: request 0 draws 5, 6, 1, 2 (rejects 7 at its third row); request 1 draws 3;
    # request 2 draws 8, 9 and a bonus 4.
    sampled = [5, 6, 1, 2, 3, 8, 9, 4]
    entries = [Logprobs([t], [-float(i)], 1) for i, t in enumerate(sampled)]
    tokens, logprobs = accept(drafts, sampled, entries)
    assert tokens == [[5, 6, 1], [3], [8, 9, 4]]
    assert logprobs == [entries[0:3], entries[4:5], entries[5:8]]
    assert accept([[5]], [4, 5], None) == ([[4]], None)  # the first draft rejected


def test_rows_count_the_drafts_before_them_as_outputs() -> None:
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0).resolve()
    row = SamplingRow(params, [1, 2], [3], None, {0})
    rows = expand_rows([row], [[7, 8]])
    assert [r.output_token_ids for r in rows] == [[3], [3, 7], [3, 7, 8]]
    assert row.output_token_ids == [3]


class _Request:
    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids


def test_drafts_follow_the_tokens_only_within_the_block() -> None:
    requests = {"a": _Request([1, 2]), "b": _Request([3])}
    with drafts_in_tokens(requests, {"a": [9, 9], "b": []}):
        assert requests["a"].token_ids == [1, 2, 9, 9] and requests["b"].token_ids == [3]
    assert requests["a"].token_ids == [1, 2] and requests["b"].token_ids == [3]


def test_a_request_whose_drafts_keep_failing_proposes_fewer_then_none() -> None:
    from ferrum.model_executor.runner_state import CachedRequestState
    from ferrum.model_executor.speculative.decoder import drafts_worth_proposing

    params = SamplingParams(temperature=0.0).resolve()
    state = CachedRequestState("r", [1], [], [1], params, ([0],), 0, None)
    assert drafts_worth_proposing(state, 3) == 3
    state.draft_acceptance = 0.2
    assert drafts_worth_proposing(state, 3) == 1
    state.draft_acceptance = 0.05
    counts = [drafts_worth_proposing(state, 3) for _ in range(30)]
    # None while the average stays low; it creeps back up and the request tries one again.
    assert counts[:9] == [0] * 9 and 1 in counts


def test_the_memory_profile_covers_verify_steps_and_graphs(monkeypatch) -> None:  # noqa: ANN001
    """A verify step samples a row per request and per draft of the (fewer than
    disable_by_batch_size) requests that speculate: the profile's sampling takes that many, and
    its CUDA-graph pool is that of the largest verify graph when it has more tokens."""
    import types

    import torch

    from ferrum.model_executor import gpu_memory_profile
    from ferrum.speculative_config import SpeculativeConfig
    from ferrum.speculative_config import max_sampled_rows as rows_of

    def max_sampled_rows(c: types.SimpleNamespace) -> int:
        return rows_of(c.scheduler_config.max_num_seqs, c.speculative_config)

    def config(spec: SpeculativeConfig | None) -> types.SimpleNamespace:
        sched = types.SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
        cache = types.SimpleNamespace(gpu_memory_utilization=0.9)
        return types.SimpleNamespace(
            scheduler_config=sched,
            cache_config=cache,
            speculative_config=spec,
            lora_config=types.SimpleNamespace(enable_lora=False),
        )

    ngram = dict(method="ngram", num_speculative_tokens=3)
    assert max_sampled_rows(config(None)) == 8
    assert max_sampled_rows(config(SpeculativeConfig(**ngram, disable_by_batch_size=4))) == 17
    unbounded = config(SpeculativeConfig(**ngram, disable_by_batch_size=None))
    assert max_sampled_rows(unbounded) == 32

    for name in ("reset_peak_memory_stats", "synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (1 << 40, 1 << 40))
    for name in ("memory_reserved", "memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 6400)  # activations
    sampled_rows = []
    model = types.SimpleNamespace(compute_logits=lambda h: sampled_rows.append(len(h)) or h)
    runner = types.SimpleNamespace(
        config=unbounded,
        device=torch.device("cpu"),
        block_size=4,
        kv_cache_groups=[types.SimpleNamespace(recurrent=False)],
        initialize_kv_cache=lambda counts: None,
        forward_prompts=lambda seq_lens: torch.zeros(sum(seq_lens), 16),
        model=model,
        sampler=lambda logits, meta: None,
        vocab_size=16,
        sampling_staging=None,
        release_kv_cache=lambda: None,
        uses_cuda_graphs=lambda: True,
    )
    monkeypatch.setattr(gpu_memory_profile.SamplingMetadata, "from_rows", lambda *a: None)
    budget = gpu_memory_profile.profile_gpu_kv_budget(runner)
    assert sampled_rows == [32]
    # The graph pool: the activations of the largest graph's tokens out of the profiled 64,
    # here a verify batch of 8 requests of 4 tokens (32), not max_num_seqs (8).
    assert budget == int((1 << 40) * 0.9) - 6400 - 6400 * 32 // 64
