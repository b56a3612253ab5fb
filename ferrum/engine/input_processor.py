"""The one path from a user's prompt and SamplingParams to the core's requests: validation,
max_tokens and EOS resolution, and the fan-out of `n` into one core request per completion."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ferrum.config import ModelConfig
from ferrum.engine.core_messages import EngineCoreRequest
from ferrum.engine.tokenizer import Tokenizer
from ferrum.request import check_request_fits
from ferrum.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    """A prompt `InputProcessor.process_prompt` accepted: its text (if given) and token ids."""

    text: str | None
    token_ids: list[int]


# Text, {"prompt": text} / {"prompt_token_ids": [...]} (vLLM's TextPrompt / TokensPrompt), or a
# prompt already processed.
PromptType = str | dict[str, Any] | ProcessedPrompt


def load_tokenizer(model_config: ModelConfig) -> Tokenizer | None:
    if model_config.skip_tokenizer_init:
        return None
    return Tokenizer.from_pretrained(model_config.tokenizer)


def eos_token_ids(model_config: ModelConfig, tokenizer: Tokenizer | None) -> list[int]:
    """The tokenizer's EOS first (it stops with stop_reason None), then generation_config.json's
    others (stop_reason: the id); all of them stop unless ignore_eos."""
    ids = model_config.eos_token_ids()
    primary = None if tokenizer is None else tokenizer.eos_token_id
    if primary is not None:
        ids = [primary] + [i for i in ids if i != primary]
    return ids


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}#{request_id}"


class InputProcessor:
    def __init__(
        self, model_config: ModelConfig, tokenizer: Tokenizer | None, max_tokens_in_pool: int
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = model_config.vocab_size
        self.max_model_len = model_config.max_model_len
        self.pool_tokens = max_tokens_in_pool
        # A text longer than this cannot fit in max_model_len tokens (see
        # Tokenizer.max_token_chars), so it is refused before the tokenizer spends time on it.
        self.max_prompt_chars = self.max_model_len * (tokenizer.max_token_chars if tokenizer else 1)
        self.eos_token_ids = eos_token_ids(model_config, tokenizer)

    def max_tokens_room(self, num_prompt_tokens: int) -> int:
        """The most output tokens a prompt of this length can get (context and KV pool)."""
        return min(self.max_model_len, self.pool_tokens) - num_prompt_tokens

    def check_prompt_chars(self, num_chars: int, field: str = "prompt") -> None:
        """Raises ValueError when a text of `num_chars` characters is sure to exceed
        max_model_len tokens."""
        if num_chars > self.max_prompt_chars:
            raise ValueError(
                f"{field}: {num_chars} characters cannot fit in max_model_len={self.max_model_len} "
                f"tokens (at most {self.max_prompt_chars} characters: no token of this tokenizer "
                f"spans more than {self.max_prompt_chars // self.max_model_len})"
            )

    def describe_limits(self) -> str:
        """The length limits a request is checked against, for error messages."""
        return f"max_model_len={self.max_model_len}, KV cache capacity {self.pool_tokens} tokens"

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> tuple[ProcessedPrompt, list[EngineCoreRequest]]:
        """Validates one request and fans it out into one core request per completion of `n`
        (seeded completions get seeds seed, seed+1, ...); raises ValueError naming what is wrong."""
        prompt = self.process_prompt(prompt)
        params = self.resolve_params(params, len(prompt.token_ids))
        eos = None if params.ignore_eos or not self.eos_token_ids else self.eos_token_ids[0]
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        requests = []
        for index in range(params.n):
            child = params.clone() if index else params
            if index and params.seed is not None:
                child.seed = params.seed + index
            req_id = child_request_id(request_id, index, params.n)
            requests.append(EngineCoreRequest(req_id, prompt.token_ids, child, eos, arrival_time))
        return prompt, requests

    def process_prompt(self, prompt: PromptType) -> ProcessedPrompt:
        """Tokenizes and checks a prompt; raises ValueError naming what is wrong."""
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        if isinstance(prompt, str):
            text, token_ids = prompt, None
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            text, token_ids = prompt["prompt"], None
        else:
            raise ValueError(
                "prompt must be a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}, "
                f"got {type(prompt).__name__}"
            )
        if token_ids is None:
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer (skip_tokenizer_init=True)")
            if not isinstance(text, str):
                raise ValueError(f"prompt must be a string, got {type(text).__name__}")
            self.check_prompt_chars(len(text))
            token_ids = self.tokenizer.encode(text)
        if not isinstance(token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in token_ids
        ):
            raise ValueError("prompt_token_ids must be a list of integers")
        if not token_ids:
            raise ValueError("prompt: the prompt is empty (0 tokens)")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad} is outside [0, {self.vocab_size})")
        return ProcessedPrompt(text, token_ids)

    def resolve_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """A copy with max_tokens=None resolved and the model's EOS ids; checks length limits."""
        params = params.clone()
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer (skip_tokenizer_init=True)")
        self._check_token_fields(params)
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - num_prompt_tokens
            if params.max_tokens < 1:
                raise ValueError(
                    f"prompt ({num_prompt_tokens} tokens) leaves no room for output under "
                    f"max_model_len={self.max_model_len}"
                )
        check_request_fits(
            num_prompt_tokens, params.max_tokens, self.max_model_len, self.pool_tokens
        )
        params.all_stop_token_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            params.all_stop_token_ids.update(self.eos_token_ids)
        return params

    def _check_token_fields(self, params: SamplingParams) -> None:
        """Token ids within the model's vocabulary; bad words tokenized; grammars need a
        tokenizer. Raises ValueError naming the field."""
        vocab = self.vocab_size
        for name, ids in (
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise ValueError(f"{name}: token id {bad} is outside [0, {vocab})")
        params.bad_words_token_ids = []
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words: need a tokenizer (skip_tokenizer_init=True)")
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
            bad = next((t for w in params.bad_words_token_ids for t in w if t >= vocab), None)
            if bad is not None:
                raise ValueError(f"bad_words: token id {bad} is outside [0, {vocab})")
        if params.structured_outputs is not None and self.tokenizer is None:
            raise ValueError(
                "structured_outputs: grammars need a tokenizer (skip_tokenizer_init=True)"
            )


def bad_words_token_ids(tokenizer: Tokenizer, bad_words: list[str]) -> list[list[int]]:
    """Each bad word's token ids as it would start the text and, when that tokenizes into as
    many tokens but a different first one, after a space (vLLM's rule)."""
    result: list[list[int]] = []
    for word in bad_words:
        word = word.lstrip()
        plain = tokenizer.encode(word, add_special_tokens=False)
        result.append(plain)
        spaced = tokenizer.encode(" " + word, add_special_tokens=False)
        if len(spaced) == len(plain) and spaced[0] != plain[0]:
            result.append(spaced)
    return result
