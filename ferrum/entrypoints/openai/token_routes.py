"""`POST /tokenize` (a prompt, or chat messages rendered with the chat template; vLLM's
`return_token_strs` adds each token's text) and `POST /detokenize`."""

from __future__ import annotations

from fastapi import FastAPI

from ferrum.engine.async_llm import AsyncLLM
from ferrum.engine.tokenizer import Tokenizer
from ferrum.entrypoints.openai.chat_protocol import TokenizeRequest
from ferrum.entrypoints.openai.http_errors import ERROR_RESPONSES, APIError
from ferrum.entrypoints.openai.protocol import DetokenizeRequest, TokenizeCompletionRequest
from ferrum.entrypoints.openai.responses import DetokenizeResponse, TokenizeResponse
from ferrum.entrypoints.openai.serving_chat import OpenAIServingChat
from ferrum.entrypoints.openai.serving_engine import off_loop


def add_token_routes(app: FastAPI, engine: AsyncLLM, chat: OpenAIServingChat) -> None:
    max_model_len = engine.config.model_config.max_model_len

    def tokenizer_of(model: str | None) -> Tokenizer:
        chat.check_request(model)
        if engine.tokenizer is None:
            raise APIError(400, "the server runs without a tokenizer (skip_tokenizer_init)")
        return engine.tokenizer

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        tokenizer = tokenizer_of(body.model)
        if isinstance(body, TokenizeCompletionRequest):
            chat.check_prompt_chars(len(body.prompt), "prompt")
            tokens = await off_loop(
                len(body.prompt), _encode, tokenizer, body.prompt, body.add_special_tokens
            )
        else:
            tokens = (await chat.render(body)).token_ids
        token_strs = None
        if body.return_token_strs:
            token_strs = await off_loop(len(tokens), _token_strs, tokenizer, tokens)
        return TokenizeResponse(
            count=len(tokens), max_model_len=max_model_len, tokens=tokens, token_strs=token_strs
        )

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        tokenizer = tokenizer_of(body.model)
        text = await off_loop(len(body.tokens), _decode, tokenizer, body.tokens)
        return DetokenizeResponse(prompt=text)


def _encode(tokenizer: Tokenizer, prompt: str, add_special_tokens: bool) -> list[int]:
    try:
        return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    except ValueError as e:
        raise APIError(400, f"prompt: {e}", param="prompt") from None


def _decode(tokenizer: Tokenizer, token_ids: list[int]) -> str:
    bad = next((t for t in token_ids if not 0 <= t < tokenizer.vocab_size), None)
    if bad is not None:
        raise APIError(
            400, f"tokens: token id {bad} is outside [0, {tokenizer.vocab_size})", param="tokens"
        )
    return tokenizer.decode(token_ids)


def _token_strs(tokenizer: Tokenizer, token_ids: list[int]) -> list[str]:
    return [tokenizer.backend.id_to_token(t) or "" for t in token_ids]
