"""Sampler test inputs: a SamplingRow of given params, the metadata of rows, the tokens a
filter keeps, and exact log-probabilities (tests/model_executor/test_sampler*.py)."""

from __future__ import annotations

import torch

from ferrum.model_executor.sampling_metadata import SamplingMetadata, SamplingRow, sampling_staging
from ferrum.sampling_params import ResolvedSamplingParams, SamplingParams

CPU = torch.device("cpu")
NEG_INF = float("-inf")


def sampling_row(
    params: SamplingParams | ResolvedSamplingParams,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    stop_token_ids: set[int] | None = None,
) -> SamplingRow:
    generator = None
    if params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)
    return SamplingRow(
        params=params.resolve() if isinstance(params, SamplingParams) else params,
        prompt_token_ids=prompt or [],
        output_token_ids=output or [],
        generator=generator,
        stop_token_ids=stop_token_ids or set(),
    )


def sampling_meta(rows: list[SamplingRow], vocab_size: int) -> SamplingMetadata:
    return SamplingMetadata.from_rows(rows, vocab_size, sampling_staging(len(rows), CPU))


def kept_tokens(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row > NEG_INF).flatten().tolist()) for row in logits]


# Log-probabilities of exact binary fractions: p = [1/2, 1/4, 1/8, 1/16, 1/16].
DYADIC = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625]).log()
