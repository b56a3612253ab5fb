"""Token sampling on the logits' device, without device-to-host syncs. Order: logprobs of the raw
logits; bitmask, allowed_token_ids, banned tokens (min_tokens, bad words), logit_bias; repetition,
frequency and presence penalties; greedy rows take the argmax; random rows apply temperature,
top-k, top-p and min-p, then take `argmax(probs / q)`, q ~ Exp(1) (token i with probability
probs[i]). Seeded rows draw q from their own generator, independent of the rest of the batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ferrum.model_executor.sampling_metadata import SamplingMetadata
from ferrum.model_executor.token_bitmask import apply_token_bitmask_
from ferrum.request import Logprobs


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    # [N, k+1]: the sampled token first, then the top-k (k = largest `logprobs` in the batch).
    logprob_token_ids: torch.Tensor | None
    logprobs: torch.Tensor | None  # [N, k+1] float32
    sampled_ranks: torch.Tensor | None  # [N] int64, 1 = most likely under the raw logits

    def start_copy_to_host(self) -> SamplerOutput:
        """The same output in pinned host memory, copied without waiting for the device: read it
        only after an event recorded behind the copies has completed."""

        def copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
            if tensor is None or tensor.device.type == "cpu":
                return tensor
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            return host.copy_(tensor, non_blocking=True)

        return SamplerOutput(
            copy(self.sampled_token_ids),
            copy(self.logprob_token_ids),
            copy(self.logprobs),
            copy(self.sampled_ranks),
        )

    def to_host(
        self, num_logprobs: Sequence[int | None]
    ) -> tuple[list[int], list[Logprobs | None] | None]:
        """Copies to the host (one sync): token ids, and per row its `num_logprobs[i]` top
        entries (None for rows that asked for none); the second item is None without logprobs."""
        if self.logprob_token_ids is None or self.logprobs is None or self.sampled_ranks is None:
            return self.sampled_token_ids.tolist(), None
        ints = torch.cat(
            [self.sampled_token_ids[:, None], self.sampled_ranks[:, None], self.logprob_token_ids],
            dim=1,
        ).tolist()
        values = self.logprobs.tolist()
        sampled, result = [], []
        for row_ints, row_values, k in zip(ints, values, num_logprobs, strict=True):
            sampled.append(row_ints[0])
            if k is None:
                result.append(None)
                continue
            result.append(
                Logprobs(
                    token_ids=row_ints[2 : 3 + k],
                    logprobs=row_values[: 1 + k],
                    sampled_rank=row_ints[1],
                )
            )
        return sampled, result


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty on prompt + output tokens (divides positive logits, multiplies
    negative ones); frequency (per occurrence) and presence (once) penalties on output tokens."""
    counts = meta.output_counts
    assert counts is not None
    if meta.repetition_penalty is not None:
        assert meta.prompt_mask is not None
        seen = meta.prompt_mask | (counts > 0)
        penalty = meta.repetition_penalty[:, None].expand_as(logits)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if meta.frequency_penalty is not None:
        logits = logits - meta.frequency_penalty[:, None] * counts
    if meta.presence_penalty is not None:
        logits = logits - meta.presence_penalty[:, None] * (counts > 0).to(logits.dtype)
    return logits


def apply_token_constraints(
    logits: torch.Tensor, meta: SamplingMetadata, in_place: bool = False
) -> torch.Tensor:
    """-inf where the grammar, allowed_token_ids or a ban forbids a token; + logit_bias.
    Modifies `logits` only if `in_place`."""
    if meta.grammar_bitmask is not None:
        logits = logits if in_place else logits.clone()
        apply_token_bitmask_(logits, meta.grammar_bitmask)
    # torch.full fills on the device; torch.tensor(value, device=...) would copy and sync.
    neg_inf = torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device)
    if meta.allowed_rows is not None:
        assert meta.disallowed_mask is not None
        rows = logits.index_select(0, meta.allowed_rows).masked_fill(meta.disallowed_mask, neg_inf)
        logits = logits.index_copy(0, meta.allowed_rows, rows)
    if meta.banned_rows is not None:
        logits = logits.index_put((meta.banned_rows, meta.banned_token_ids), neg_inf)
    if meta.bias_rows is not None:
        assert meta.bias_values is not None
        logits = logits.index_put(
            (meta.bias_rows, meta.bias_token_ids), meta.bias_values, accumulate=True
        )
    return logits


def _top_k_threshold(sorted_desc: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """[N, 1]: the k-th largest logit per row (-inf where top-k is off); ties with it are kept."""
    kth = sorted_desc.gather(1, (top_k - 1).clamp(min=0)[:, None])
    return torch.where(top_k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))


def _top_p_cutoff(sorted_desc: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """[N, 1]: the smallest logit that survives top-k then top-p (-inf for rows with neither).

    `sorted_desc` holds each row's largest logits in descending order: the whole row, or the
    max_top_k largest when every top-p row also has a top-k (its survivors are among those).
    """
    assert meta.top_p is not None
    top_p = meta.top_p[:, None]
    active = top_p < 1.0
    if meta.top_k is not None:
        kth = _top_k_threshold(sorted_desc, meta.top_k)
        sorted_desc = sorted_desc.masked_fill(sorted_desc < kth, float("-inf"))
        active = active | (meta.top_k[:, None] > 0)
    probs = sorted_desc.softmax(dim=-1)
    # Mass of the strictly more likely tokens; a token is dropped once that reaches top_p.
    # Rows with top_p == 1 drop nothing, whatever the rounding of the cumulative sum.
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p) & (top_p < 1.0)
    drop[:, 0] = False
    drop |= sorted_desc == float("-inf")
    cutoff = sorted_desc.masked_fill(drop, float("inf")).amin(dim=-1, keepdim=True)
    return torch.where(active, cutoff, torch.full_like(cutoff, float("-inf")))


def apply_top_k_top_p(
    logits: torch.Tensor, meta: SamplingMetadata, whole_rows: bool = False
) -> torch.Tensor:
    """Keeps the k largest logits, then the smallest set of tokens whose probability mass
    (renormalized after top-k) reaches top_p; the most likely token always survives. Tokens
    tied with the last survivor survive too. `whole_rows`: top-p sorts whole rows, never the
    batch's max_top_k columns (a width other rows set would change the softmax's rounding)."""
    if meta.top_p is None:
        if meta.top_k is None:
            return logits
        largest = logits.topk(meta.max_top_k, dim=-1).values
        return logits.masked_fill(logits < _top_k_threshold(largest, meta.top_k), float("-inf"))
    if meta.top_k_covers_top_p and not whole_rows:
        candidates = logits.topk(meta.max_top_k, dim=-1).values
    else:
        candidates = logits.sort(dim=-1, descending=True).values
    return logits.masked_fill(logits < _top_p_cutoff(candidates, meta), float("-inf"))


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zeroes probabilities below min_p times the row's largest (the result is unnormalized)."""
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < threshold, 0.0)


def _exponential_race(
    probs: torch.Tensor, meta: SamplingMetadata, generator: torch.Generator | None
) -> torch.Tensor:
    """Samples one token per row from `probs` (rows need not be normalized; modified in place)."""
    q = torch.empty_like(probs)
    if len(meta.generators) < meta.num_rows:
        q.exponential_(generator=generator)
    for row, row_generator in meta.generators.items():
        q[row].exponential_(generator=row_generator)
    # q == 0 would turn a masked token's 0 / q into NaN, which argmax would pick.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)


def advance_sampling_generator(
    generator: torch.Generator, num_tokens: int, vocab_size: int, device: torch.device
) -> None:
    """Moves a seeded row's generator past `num_tokens` sampled tokens: each token took exactly
    the draw `_exponential_race` makes for one row (vocab_size float32 exponentials)."""
    if num_tokens <= 0:
        return
    row = torch.empty(vocab_size, dtype=torch.float32, device=device)
    for _ in range(num_tokens):
        row.exponential_(generator=generator)


class Sampler:
    """Picks one token per row from [N, V] logits; see the module docstring for the order.
    `batch_invariant`: no step's width depends on the other rows."""

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def __call__(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        generator: torch.Generator | None = None,
    ) -> SamplerOutput:
        """`generator` drives unseeded random rows (None: torch's default generator)."""
        if logits.dim() != 2 or logits.shape != (metadata.num_rows, metadata.vocab_size):
            raise ValueError(
                f"logits must have shape [num_rows={metadata.num_rows}, "
                f"vocab_size={metadata.vocab_size}], got {list(logits.shape)}"
            )
        # A float32 input is the caller's: it must not be modified.
        owned = logits.dtype != torch.float32
        logits = logits.float()
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)

        logits = apply_token_constraints(logits, metadata, in_place=owned)
        if metadata.uses_penalties:
            logits = apply_penalties(logits, metadata)

        sampled = self._sample(logits, metadata, generator)
        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        return self._gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)

    def _sample(
        self, logits: torch.Tensor, meta: SamplingMetadata, generator: torch.Generator | None
    ) -> torch.Tensor:
        greedy = None if meta.all_random else logits.argmax(dim=-1)
        if meta.all_greedy:
            assert greedy is not None
            return greedy
        assert meta.temperature is not None
        logits = logits / meta.temperature[:, None]
        if meta.top_k is not None or meta.top_p is not None:
            logits = apply_top_k_top_p(logits, meta, self.batch_invariant)
        probs = logits.softmax(dim=-1)
        if meta.min_p is not None:
            probs = apply_min_p(probs, meta.min_p)
        random = _exponential_race(probs, meta, generator)
        if greedy is None:
            return random
        return torch.where(meta.greedy_mask, greedy, random)

    @staticmethod
    def _gather_logprobs(
        raw_logprobs: torch.Tensor, sampled: torch.Tensor, k: int
    ) -> SamplerOutput:
        sampled_logprob = raw_logprobs.gather(1, sampled[:, None])
        ranks = (raw_logprobs > sampled_logprob).sum(dim=-1) + 1
        top_values, top_ids = raw_logprobs.topk(k, dim=-1)
        return SamplerOutput(
            sampled_token_ids=sampled,
            logprob_token_ids=torch.cat([sampled[:, None], top_ids], dim=1),
            logprobs=torch.cat([sampled_logprob, top_values], dim=1),
            sampled_ranks=ranks,
        )
