"""Shared by the speculative-decoding tests through `LLM`: prompts that repeat themselves (the
n-gram proposer finds drafts in them), greedy generation over them, the n-gram config, a replay
proposer's file of recorded continuations, and a recorder of a head proposer's drafts."""

from __future__ import annotations

import json
from pathlib import Path

from ferrum import LLM, SamplingParams
from tests.utils.tiny_llm import random_prompts

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
