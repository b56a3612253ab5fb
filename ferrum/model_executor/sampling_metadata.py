"""Per-step sampling tensors for a batch, built once from what the runner knows about each row.

A field is None when no row in the batch needs it, so the sampler can skip that stage without
looking at tensor values (no device-to-host syncs).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ferrum.model_executor.staging_buffer import StagingBuffer, staging_bytes
from ferrum.sampling_params import ResolvedSamplingParams


@dataclass(slots=True)
class SamplingRow:
    """What the runner knows about one batch row."""

    params: ResolvedSamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # The request's own generator when params.seed is set, on the logits' device.
    generator: torch.Generator | None
    # EOS (unless ignore_eos) and params.stop_token_ids: masked while the row has fewer than
    # min_tokens output tokens.
    stop_token_ids: set[int]
    # Output tokens sampled by launched steps that output_token_ids does not hold yet.
    num_output_placeholders: int = 0


def sampling_staging(max_num_rows: int, device: torch.device) -> StagingBuffer:
    """Room for every per-row field of up to max_num_rows rows: six float32, top_k, greedy_mask."""
    per_row = [(max_num_rows, torch.float32)] * 6
    num_bytes = staging_bytes(*per_row, (max_num_rows, torch.int64), (max_num_rows, torch.bool))
    return StagingBuffer(num_bytes, torch.device(device))


def _put(staging: StagingBuffer, values: list, dtype: torch.dtype) -> torch.Tensor:
    host, device = staging.take(len(values), dtype)
    host[:] = values
    return device


def to_device(data: list | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host -> device copy of data whose size no config bounds, that never waits for the device
    (pinned + non_blocking on CUDA)."""
    cpu = torch.as_tensor(np.asarray(data)).to(dtype)
    if device.type == "cuda":
        return cpu.pin_memory().to(device, non_blocking=True)
    return cpu.to(device)


def _token_counts(
    rows: list[list[int]], vocab_size: int, device: torch.device, dtype: torch.dtype, field: str
) -> torch.Tensor:
    """[len(rows), vocab_size]: how often each token id occurs in each row."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    total = int(lengths.sum())
    counts = torch.zeros(len(rows), vocab_size, dtype=dtype, device=device)
    if total == 0:
        return counts
    ids = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=total)
    assert ids.min() >= 0 and ids.max() < vocab_size, f"{field} outside the vocabulary"
    row_index = np.repeat(np.arange(len(rows), dtype=np.int64), lengths)
    flat = to_device(row_index * vocab_size + ids, torch.int64, device)
    counts.view(-1).index_add_(0, flat, torch.ones(total, dtype=dtype, device=device))
    return counts


@dataclass(slots=True)
class SamplingMetadata:
    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    # [N] bool, True for greedy rows; None unless the batch mixes greedy and random rows.
    greedy_mask: torch.Tensor | None
    # [N] float32; greedy rows hold 1.0. None when all rows are greedy.
    temperature: torch.Tensor | None
    # [N] int64, 0 = disabled; None when no random row uses top-k.
    top_k: torch.Tensor | None
    max_top_k: int
    # Every row with top-p also has top-k: its survivors lie among the max_top_k largest logits.
    top_k_covers_top_p: bool
    top_p: torch.Tensor | None  # [N] float32, 1.0 = disabled
    min_p: torch.Tensor | None  # [N] float32, 0.0 = disabled
    # Row index -> the row's own generator (seeded random rows only).
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # Penalties: each is None when no row uses it.
    repetition_penalty: torch.Tensor | None = None  # [N] float32
    frequency_penalty: torch.Tensor | None = None  # [N] float32
    presence_penalty: torch.Tensor | None = None  # [N] float32
    prompt_mask: torch.Tensor | None = None  # [N, V] bool: token occurs in the prompt
    output_counts: torch.Tensor | None = None  # [N, V] float32: occurrences in the output
    # Tokens banned this step, as parallel [M] row / token id tensors: the stop ids while a row
    # is below min_tokens, and each bad word's last token where the output ends with its others.
    banned_rows: torch.Tensor | None = None
    banned_token_ids: torch.Tensor | None = None
    # logit_bias as parallel [M] row / token id / bias tensors.
    bias_rows: torch.Tensor | None = None
    bias_token_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # allowed_token_ids: the rows that have them, and [len(rows), V] True where a token is not
    # allowed.
    allowed_rows: torch.Tensor | None = None
    disallowed_mask: torch.Tensor | None = None
    # Structured outputs: [N, ceil(V / 32)] int32 next-token bitmask (all ones on free rows).
    grammar_bitmask: torch.Tensor | None = None
    # Largest `logprobs` asked in the batch; None when no row asks.
    max_num_logprobs: int | None = None

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty is not None
            or self.frequency_penalty is not None
            or self.presence_penalty is not None
        )

    @classmethod
    def from_rows(
        cls, rows: list[SamplingRow], vocab_size: int, staging: StagingBuffer
    ) -> SamplingMetadata:
        """Per-row fields go to the device in one copy from `staging`, token counts and the
        min_tokens mask in copies of their own."""
        if not rows:
            raise ValueError("SamplingMetadata needs at least one row")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        params = [r.params for r in rows]
        greedy = [p.temperature == 0.0 for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)

        meta = cls(
            num_rows=len(rows),
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=None,
            temperature=None,
            top_k=None,
            max_top_k=0,
            top_k_covers_top_p=False,
            top_p=None,
            min_p=None,
        )
        staging.begin()
        if not all_greedy:
            meta._fill_random(rows, greedy, staging)
        meta._fill_penalties(rows, staging)
        staging.copy()
        meta._fill_banned(rows, staging.device)
        meta._fill_logit_bias(rows, staging.device)
        meta._fill_allowed(rows, staging.device)
        asked = [p.logprobs for p in params if p.logprobs is not None]
        meta.max_num_logprobs = max(asked) if asked else None
        return meta

    def _fill_random(
        self, rows: list[SamplingRow], greedy: list[bool], staging: StagingBuffer
    ) -> None:
        params = [r.params for r in rows]
        if not self.all_random:
            self.greedy_mask = _put(staging, greedy, torch.bool)
        self.temperature = _put(
            staging, [1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32
        )
        top_k = [min(p.top_k, self.vocab_size) for p in params]
        if any(top_k):
            self.top_k = _put(staging, top_k, torch.int64)
            self.max_top_k = max(top_k)
        if any(p.top_p < 1.0 for p in params):
            self.top_p = _put(staging, [p.top_p for p in params], torch.float32)
            self.top_k_covers_top_p = all(k > 0 for k, p in zip(top_k, params) if p.top_p < 1.0)
        if any(p.min_p > 0.0 for p in params):
            self.min_p = _put(staging, [p.min_p for p in params], torch.float32)
        for i, (row, g) in enumerate(zip(rows, greedy)):
            if not g and row.generator is not None:
                self.generators[i] = row.generator

    def _fill_penalties(self, rows: list[SamplingRow], staging: StagingBuffer) -> None:
        params = [r.params for r in rows]
        if not any(p.uses_penalties for p in params):
            return
        device = staging.device
        # Rows without a penalty get no token counts: their neutral values ignore them anyway.
        if any(p.repetition_penalty != 1.0 for p in params):
            self.repetition_penalty = _put(
                staging, [p.repetition_penalty for p in params], torch.float32
            )
            prompts = [
                r.prompt_token_ids if r.params.repetition_penalty != 1.0 else [] for r in rows
            ]
            prompt_counts = _token_counts(
                prompts, self.vocab_size, device, torch.int32, "prompt_token_ids"
            )
            self.prompt_mask = prompt_counts > 0
        if any(p.frequency_penalty != 0.0 for p in params):
            self.frequency_penalty = _put(
                staging, [p.frequency_penalty for p in params], torch.float32
            )
        if any(p.presence_penalty != 0.0 for p in params):
            self.presence_penalty = _put(
                staging, [p.presence_penalty for p in params], torch.float32
            )
        outputs = [r.output_token_ids if r.params.uses_penalties else [] for r in rows]
        self.output_counts = _token_counts(
            outputs, self.vocab_size, device, torch.float32, "output_token_ids"
        )

    def _fill_banned(self, rows: list[SamplingRow], device: torch.device) -> None:
        row_index: list[int] = []
        token_ids: list[int] = []
        for i, row in enumerate(rows):
            banned: set[int] = set()
            num_outputs = len(row.output_token_ids) + row.num_output_placeholders
            # A grammar's row gets min_tokens from its bitmask (see GrammarBitmaskBuffers.fill).
            if num_outputs < row.params.min_tokens and row.params.structured_outputs is None:
                banned.update(row.stop_token_ids)
            if row.params.bad_words_token_ids:
                # The engine waits for every output token before a row with bad words samples.
                assert not row.num_output_placeholders, "bad words need the output on the host"
                banned.update(_bad_word_ends(row.params.bad_words_token_ids, row.output_token_ids))
            # Ids outside the logits can never be sampled, so they need no mask.
            ids = sorted(t for t in banned if 0 <= t < self.vocab_size)
            row_index.extend([i] * len(ids))
            token_ids.extend(ids)
        if token_ids:
            self.banned_rows = to_device(row_index, torch.int64, device)
            self.banned_token_ids = to_device(token_ids, torch.int64, device)

    def _fill_logit_bias(self, rows: list[SamplingRow], device: torch.device) -> None:
        row_index: list[int] = []
        token_ids: list[int] = []
        values: list[float] = []
        for i, row in enumerate(rows):
            for token_id, bias in (row.params.logit_bias or {}).items():
                assert token_id < self.vocab_size, "the front end checks logit_bias"
                row_index.append(i)
                token_ids.append(token_id)
                values.append(bias)
        if token_ids:
            self.bias_rows = to_device(row_index, torch.int64, device)
            self.bias_token_ids = to_device(token_ids, torch.int64, device)
            self.bias_values = to_device(values, torch.float32, device)

    def _fill_allowed(self, rows: list[SamplingRow], device: torch.device) -> None:
        allowed_rows = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
        if not allowed_rows:
            return
        local_index: list[int] = []
        token_ids: list[int] = []
        for k, i in enumerate(allowed_rows):
            ids = rows[i].params.allowed_token_ids
            assert ids is not None
            local_index.extend([k] * len(ids))
            token_ids.extend(ids)
        assert max(token_ids) < self.vocab_size, "the front end checks allowed_token_ids"
        mask = torch.ones(len(allowed_rows), self.vocab_size, dtype=torch.bool, device=device)
        mask[
            to_device(local_index, torch.int64, device), to_device(token_ids, torch.int64, device)
        ] = False
        self.allowed_rows = to_device(allowed_rows, torch.int64, device)
        self.disallowed_mask = mask


def _bad_word_ends(
    bad_words_token_ids: Sequence[tuple[int, ...]], output_token_ids: list[int]
) -> set[int]:
    """The last token of every bad word whose other tokens end the output (vLLM's rule)."""
    banned = set()
    for word in bad_words_token_ids:
        prefix = word[:-1]
        if len(prefix) > len(output_token_ids):
            continue
        if not prefix or tuple(output_token_ids[-len(prefix) :]) == prefix:
            banned.add(word[-1])
    return banned
