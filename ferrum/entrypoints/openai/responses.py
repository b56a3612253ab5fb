"""Pydantic models of the OpenAI-compatible HTTP API's responses shared by every endpoint: usage,
/v1/completions (whole and streamed), /v1/models, /tokenize, /detokenize, /version and /health.
Chat's own are in chat_protocol.py, the requests and errors in protocol.py."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from ferrum.entrypoints.openai.protocol import OpenAIModel


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIModel):
    """vLLM's prompt_logprobs entry for one token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt position (None for the first): token id (as text) -> its entry.
PromptLogprobsJSON = list[dict[str, PromptLogprob] | None]


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsJSON | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ferrum"
    root: str
    # A LoRA adapter's base model (vLLM's field); None for a base model.
    parent: str | None = None
    max_model_len: int


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    # With return_token_strs: each token's vocabulary string (vLLM's).
    token_strs: list[str] | None = None


class DetokenizeResponse(OpenAIModel):
    prompt: str


class VersionResponse(OpenAIModel):
    version: str


class HealthResponse(OpenAIModel):
    status: Literal["ok"] = "ok"
