"""The scheduler's side of speculative decoding. A decoding request carries the proposer's drafts
(`Request.spec_token_ids`); a step schedules its next token plus as many drafts as its length
limits, the token budget and the KV pool allow, and the step's output says how many the target
accepted. The KV slots of rejected drafts stay with the request and are overwritten by its next
tokens: its computed count moves back past them, and a block is cached only once every token in
it is known (drafts never are)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ferrum.request import Request


def drafts_to_verify(request: Request, budget: int, max_model_len: int) -> list[int]:
    """Takes the request's drafts (it holds none afterwards) and returns those a step verifies
    beside its next token: none unless that token is its only one to compute, and never so many
    that the accepted ones plus the sampled one could pass max_tokens or max_model_len."""
    drafts, request.spec_token_ids = request.spec_token_ids, []
    if not drafts or request.num_tokens - request.num_computed_tokens != 1:
        return []
    if request.num_output_placeholders:
        return []
    limit = min(
        budget - 1,
        request.max_tokens - request.num_output_tokens - 1,
        max_model_len - request.num_tokens - 1,
    )
    return drafts[: max(limit, 0)]


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters since start-up (vLLM's spec_decode metrics): verified drafts (one per request
    and step), draft tokens, accepted ones, and accepted ones by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        grow = num_draft_tokens - len(self.accepted_per_position)
        if grow > 0:
            self.accepted_per_position.extend([0] * grow)
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
