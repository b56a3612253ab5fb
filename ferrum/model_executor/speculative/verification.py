"""Verifying drafts by sampling. A request with drafts d_1..d_k runs k + 1 rows through the
sampler: row j holds the target's logits after the request's tokens and d_1..d_j, processed like
any row (penalties and min_tokens count d_1..d_j as outputs). Each row draws x_j from its own
distribution p_j; d_(j+1) is accepted while x_j == d_(j+1), and the step emits x_0..x_a, where a
is the first row whose draw differs from its draft (or k: every draft accepted, x_k the bonus).

This is rejection sampling for drafts proposed with certainty (q = one-hot on the draft): the
draft is accepted with probability p_j(d) = min(1, p_j(d) / q(d)), and a rejected row's draw is
distributed as p_j without d, renormalized = (p_j - q)+ normalized. Every emitted token is thus a
draw from the target's distribution given the tokens before it: the outputs are distributed
exactly as without speculation (greedy rows: the argmax, hence the same tokens)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch

from ferrum.model_executor.input_batch import RequestTokens
from ferrum.model_executor.runner_state import CachedRequestState
from ferrum.model_executor.sampler import advance_sampling_generator
from ferrum.model_executor.sampling_metadata import SamplingRow
from ferrum.request import Logprobs


def expand_rows(rows: list[SamplingRow], drafts: Sequence[list[int]]) -> list[SamplingRow]:
    """Row i becomes len(drafts[i]) + 1 rows, the jth with drafts[i][:j] as further outputs."""
    expanded = []
    for row, row_drafts in zip(rows, drafts, strict=True):
        expanded.append(row)
        for j in range(1, len(row_drafts) + 1):
            expanded.append(
                SamplingRow(
                    params=row.params,
                    prompt_token_ids=row.prompt_token_ids,
                    output_token_ids=row.output_token_ids + row_drafts[:j],
                    generator=row.generator,
                    stop_token_ids=row.stop_token_ids,
                    num_output_placeholders=row.num_output_placeholders,
                )
            )
    return expanded


def accept(
    drafts: Sequence[list[int]],
    sampled: list[int],
    logprobs: list[Logprobs | None] | None,
) -> tuple[list[list[int]], list[list[Logprobs | None]] | None]:
    """Per request: the tokens it emits (its accepted drafts, then one sampled token) and their
    logprobs, from the expanded rows' draws."""
    tokens: list[list[int]] = []
    token_logprobs: list[list[Logprobs | None]] | None = None if logprobs is None else []
    row = 0
    for row_drafts in drafts:
        emitted = []
        for j in range(len(row_drafts) + 1):
            emitted.append(sampled[row + j])
            if j == len(row_drafts) or sampled[row + j] != row_drafts[j]:
                break
        tokens.append(emitted)
        if token_logprobs is not None and logprobs is not None:
            token_logprobs.append(logprobs[row : row + len(emitted)])
        row += len(row_drafts) + 1
    return tokens, token_logprobs


def generator_states(
    states: Sequence[CachedRequestState], drafts: Sequence[list[int]]
) -> dict[int, torch.Tensor]:
    """Before a verify step samples: the generator state of each seeded request with drafts."""
    return {
        i: state.generator.get_state()
        for i, (state, row_drafts) in enumerate(zip(states, drafts))
        if row_drafts and state.generator is not None
    }


def rewind_generators(
    states: Sequence[CachedRequestState],
    saved: Mapping[int, torch.Tensor],
    tokens: Sequence[list[int]],
    vocab_size: int,
    device: torch.device,
) -> None:
    """Each of a seeded request's k + 1 rows drew once; one that emitted fewer tokens goes back
    to `saved` plus a draw per emitted token. It thus draws once per output token as without
    speculation: its seed gives the same tokens whatever runs beside it and after a restart."""
    for i, state in saved.items():
        generator = states[i].generator
        assert generator is not None
        generator.set_state(state)
        advance_sampling_generator(generator, len(tokens[i]), vocab_size, device)


@contextmanager
def drafts_in_tokens(
    requests: Mapping[str, RequestTokens], drafts: Mapping[str, list[int]]
) -> Iterator[None]:
    """Within: each request's drafts follow its tokens, as inputs of the verifying forward."""
    drafts = {req_id: row_drafts for req_id, row_drafts in drafts.items() if row_drafts}
    for req_id, row_drafts in drafts.items():
        requests[req_id].token_ids.extend(row_drafts)
    try:
        yield
    finally:
        for req_id, row_drafts in drafts.items():
            del requests[req_id].token_ids[-len(row_drafts) :]
