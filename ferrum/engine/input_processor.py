"""Validates prompts and sampling parameters before anything is queued."""

from __future__ import annotations

from typing import Any

from ferrum.engine.tokenizer import Tokenizer
from ferrum.sampling_params import SamplingParams
from ferrum.scheduler.scheduler import check_request_fits

# A prompt: text, or {"prompt": text} / {"prompt_token_ids": [...]} (vLLM's TextPrompt / TokensPrompt).
PromptType = str | dict[str, Any]


class InputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        max_model_len: int,
        pool_tokens: int,
        eos_token_ids: list[int],
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.pool_tokens = pool_tokens
        # The first id is the primary EOS (stop_reason None); all of them stop unless ignore_eos.
        self.eos_token_ids = eos_token_ids

    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Returns (text or None, token ids); raises ValueError naming what is wrong."""
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
        return text, token_ids

    def resolve_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """A copy with max_tokens=None resolved and the model's EOS ids; checks length limits."""
        params = params.clone()
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer (skip_tokenizer_init=True)")
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

    def eos_for(self, params: SamplingParams) -> int | None:
        return None if params.ignore_eos or not self.eos_token_ids else self.eos_token_ids[0]

    def child_params(self, params: SamplingParams) -> list[SamplingParams]:
        """One SamplingParams per completion of `n`; seeded children get seeds seed, seed+1, ..."""
        children = []
        for index in range(params.n):
            child = params.clone()
            if params.seed is not None:
                child.seed = params.seed + index
            children.append(child)
        return children
