"""Shared by the speculative-decoding tests through `LLM`: prompts that repeat themselves (the
n-gram proposer finds drafts in them), greedy generation over them, the n-gram config, a replay
proposer's file of recorded continuations, the accepted fraction of drafts, the chunked /
prefix-hit / preemption check of a hybrid model, and a recorder of a head proposer's drafts."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ferrum import LLM, SamplingParams
from tests.utils.tiny_llm import make_llm, random_prompts

PROMPTS = [p + p[:7] for p in random_prompts([9, 17, 26, 13, 5], seed=21)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None}


def generate(
    llm: LLM, prompts: list[list[int]] = PROMPTS, params: SamplingParams = GREEDY
) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def replay_config(
    path: Path, expected: list[list[int]], rate: float, prompts: list[list[int]] = PROMPTS
) -> dict:
    """A replay proposer (4 drafts) of `expected[i]` after `prompts[i]`, written to `path`."""
    path.write_text(json.dumps({",".join(map(str, p)): o for p, o in zip(prompts, expected)}))
    return {
        "method": "replay",
        "num_speculative_tokens": 4,
        "model": str(path),
        "acceptance_rate": rate,
        "disable_by_batch_size": None,
    }


def accepted_fraction(llm: LLM) -> float:
    stats = llm.llm_engine.stats()
    assert stats.spec_num_draft_tokens > 0
    return stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens


def check_chunks_prefix_hits_and_preemption(
    checkpoint: str,
    spec: dict,
    expected: list[list[int]],
    run: Callable[[LLM], list[list[int]]] = generate,
) -> None:
    """`run`'s greedy tokens with `spec` stay `expected` over chunks of at most 6 tokens with state
    snapshots every 2 blocks (a second run hits them), and in a pool of 17 blocks that preempts
    (the state is recomputed from the prompt and the accepted tokens)."""
    chunked = make_llm(
        checkpoint, speculative_config=spec, max_num_batched_tokens=6, recurrent_snapshot_interval=8
    )
    assert run(chunked) == expected
    assert run(chunked) == expected  # every prompt now hits a snapshot
    assert chunked.llm_engine.stats().prefix_cache_hits > 0
    tight = make_llm(checkpoint, speculative_config=spec, num_kv_blocks=17)
    assert run(tight) == expected
    assert tight.llm_engine.stats().num_preemptions > 0


def record_proposals(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """A list that fills, as `llm` runs, with (a request's tokens, the drafts its EAGLE-3 or MTP
    head proposed after them) for every proposal."""
    proposer = llm.llm_engine.client.core.executor.runner.speculative.eagle3
    propose, proposals = proposer.propose, []

    def recorded(inputs, states, *args):  # noqa: ANN001, ANN002, ANN202
        drafts = propose(inputs, states, *args)
        proposals.extend(
            (list(s.token_ids), drafts[s.req_id]) for s in states if s.req_id in drafts
        )
        return drafts

    proposer.propose = recorded
    return proposals
