"""The one place a request is checked: from a user's prompt and SamplingParams to a frozen
`ProcessedRequest` (the prompt's type, text length, token ids and the length limits; token-id
fields; max_tokens, each completion's seed and stop ids resolved; `n` fanned out into one core
request per completion). Every layer below trusts it; errors are `FieldError`s naming the field."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ferrum.config import ModelConfig
from ferrum.engine.core_messages import EngineCoreRequest
from ferrum.engine.tokenizer import Tokenizer
from ferrum.errors import FieldError
from ferrum.lora_request import LoRARequest
from ferrum.request import check_request_fits
from ferrum.sampling_params import RequestOutputKind, SamplingParams

_PROMPT_TYPES = "a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}"


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    """A prompt `InputProcessor.process_prompt` accepted: its text (if given) and token ids."""

    text: str | None
    token_ids: list[int]


# Text, {"prompt": text} / {"prompt_token_ids": [...]} (vLLM's TextPrompt / TokensPrompt), or a
# prompt already processed.
PromptType = str | dict[str, Any] | ProcessedPrompt


@dataclass(frozen=True, slots=True)
class ProcessedRequest:
    """A request as accepted: the user's SamplingParams (read for detokenization, never changed),
    and its completions as the engine core runs them."""

    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams
    output_kind: RequestOutputKind
    arrival_time: float
    core_requests: tuple[EngineCoreRequest, ...]


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
        self.max_logprobs = model_config.max_logprobs

    def max_tokens_room(self, num_prompt_tokens: int) -> int:
        """The most output tokens a prompt of this length can get (context and KV pool)."""
        return min(self.max_model_len, self.pool_tokens) - num_prompt_tokens

    def check_prompt_chars(self, num_chars: int, field: str = "prompt") -> None:
        """Raises FieldError when a text of `num_chars` characters is sure to exceed
        max_model_len tokens."""
        if num_chars > self.max_prompt_chars:
            raise FieldError(
                field,
                f"{field}: {num_chars} characters cannot fit in max_model_len="
                f"{self.max_model_len} tokens (at most {self.max_prompt_chars} characters: no "
                f"token of this tokenizer spans more than "
                f"{self.max_prompt_chars // self.max_model_len})",
            )

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        *,
        output_kind: RequestOutputKind | None = None,
        default_max_tokens: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """Validates one request and fans it out into one core request per completion of `n`
        (seeded completions get seeds seed, seed+1, ...). `output_kind` overrides the params';
        unset `max_tokens` is `default_max_tokens` capped by the room left, else all of it.
        `lora_request`: the adapter of every completion, already checked (`LoRAFrontEnd`)."""
        prompt = self.process_prompt(prompt)
        self._check_token_fields(params)
        max_tokens = self._resolve_max_tokens(params, len(prompt.token_ids), default_max_tokens)
        stop_ids = () if params.ignore_eos else self.eos_token_ids
        bad_words = self._bad_words_token_ids(params)
        eos = None if params.ignore_eos or not self.eos_token_ids else self.eos_token_ids[0]
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        requests = []
        for index in range(params.n):
            seed = None if params.seed is None else params.seed + index
            resolved = params.resolve(max_tokens, seed, stop_ids, bad_words)
            req_id = child_request_id(request_id, index, params.n)
            requests.append(
                EngineCoreRequest(
                    req_id,
                    prompt.token_ids,
                    resolved,
                    eos,
                    arrival_time,
                    lora_request=lora_request,
                )
            )
        kind = params.output_kind if output_kind is None else output_kind
        return ProcessedRequest(request_id, prompt, params, kind, arrival_time, tuple(requests))

    def process_prompt(self, prompt: PromptType) -> ProcessedPrompt:
        """Tokenizes and checks a prompt (a ProcessedPrompt is already checked); raises
        TypeError for a prompt of the wrong type, FieldError for a bad one."""
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        if isinstance(prompt, str):
            text, token_ids = prompt, None
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            text, token_ids = prompt["prompt"], None
        else:
            hint = (
                " (token ids go in {'prompt_token_ids': [...]})" if isinstance(prompt, int) else ""
            )
            raise TypeError(f"prompt must be {_PROMPT_TYPES}; got {type(prompt).__name__}{hint}")
        if token_ids is None:
            if not isinstance(text, str):
                raise TypeError(f"prompt must be {_PROMPT_TYPES}; got {type(text).__name__}")
            if self.tokenizer is None:
                raise FieldError(
                    "prompt", "prompt: text prompts need a tokenizer (skip_tokenizer_init=True)"
                )
            self.check_prompt_chars(len(text))
            token_ids = self.tokenizer.encode(text)
        if not isinstance(token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in token_ids
        ):
            raise FieldError("prompt_token_ids", "prompt_token_ids must be a list of integers")
        if not token_ids:
            raise FieldError("prompt", "prompt: the prompt is empty (0 tokens)")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise FieldError(
                "prompt_token_ids",
                f"prompt_token_ids: token id {bad} is outside [0, {self.vocab_size})",
            )
        return ProcessedPrompt(text, token_ids)

    def _resolve_max_tokens(
        self, params: SamplingParams, num_prompt_tokens: int, default: int | None
    ) -> int:
        """The request's max_tokens, checked to fit; unset: `default` capped by the room left
        (context and KV pool), else all of it."""
        max_tokens = params.max_tokens
        if max_tokens is None:
            room = self.max_tokens_room(num_prompt_tokens)
            if room < 1:
                raise FieldError(
                    "prompt",
                    f"prompt ({num_prompt_tokens} tokens) leaves no room for output: "
                    f"max_model_len={self.max_model_len}, KV cache capacity {self.pool_tokens} "
                    "tokens",
                )
            max_tokens = room if default is None else min(int(default), room)
            if max_tokens < 1:
                message = f"SamplingParams.max_tokens must be an integer >= 1, got {default}"
                raise FieldError("max_tokens", message)
            if params.min_tokens > max_tokens:
                raise FieldError(
                    "min_tokens",
                    f"SamplingParams.min_tokens must be <= max_tokens={max_tokens} (the room "
                    f"the prompt leaves), got {params.min_tokens}",
                )
        check_request_fits(num_prompt_tokens, max_tokens, self.max_model_len, self.pool_tokens)
        return max_tokens

    def _check_token_fields(self, params: SamplingParams) -> None:
        """Token ids within the model's vocabulary, logprobs within max_logprobs; text fields
        need a tokenizer."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise FieldError(name, f"{name}: {value} exceeds max_logprobs={self.max_logprobs}")
        vocab = self.vocab_size
        for name, ids in (
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise FieldError(name, f"{name}: token id {bad} is outside [0, {vocab})")
        if self.tokenizer is None:
            for name, needs in (
                ("stop", "stop strings"),
                ("bad_words", "bad words"),
                ("structured_outputs", "grammars"),
            ):
                if getattr(params, name):
                    raise FieldError(
                        name, f"{name}: {needs} need a tokenizer (skip_tokenizer_init=True)"
                    )

    def _bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word's token ids as it would start the text and, when that tokenizes into
        as many tokens but a different first one, after a space (vLLM's rule)."""
        if not params.bad_words:
            return []
        assert self.tokenizer is not None
        result: list[list[int]] = []
        for word in params.bad_words:
            word = word.lstrip()
            plain = self.tokenizer.encode(word, add_special_tokens=False)
            result.append(plain)
            spaced = self.tokenizer.encode(" " + word, add_special_tokens=False)
            if len(spaced) == len(plain) and spaced[0] != plain[0]:
                result.append(spaced)
        bad = next((t for ids in result for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise FieldError(
                "bad_words", f"bad_words: token id {bad} is outside [0, {self.vocab_size})"
            )
        return result
