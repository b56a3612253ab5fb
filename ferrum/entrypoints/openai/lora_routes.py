"""LoRA adapters on the server (vLLM's interface): `--lora-modules name=path ...` at start-up,
`POST /v1/load_lora_adapter` / `POST /v1/unload_lora_adapter` while serving (behind the API key
like every working route), and a request's `model` field naming an adapter instead of the base
model. An adapter's folder is read (off the event loop) when it is added: a folder ferrum cannot
serve is a 400 naming why, and a request never waits on a bad file."""

from __future__ import annotations

import asyncio
from contextvars import ContextVar

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from ferrum.engine.async_llm import AsyncLLM
from ferrum.entrypoints.openai.http_errors import ERROR_RESPONSES, APIError
from ferrum.entrypoints.openai.protocol import RequestModel
from ferrum.errors import FieldError
from ferrum.lora_request import LoRARequest

# The adapter the current HTTP request's `model` names (None: the base model); set by the
# model check at the start of a request's handler and read when its completions are queued
# (each request is handled in its own task, with its own context).
REQUEST_LORA: ContextVar[LoRARequest | None] = ContextVar("request_lora", default=None)


class LoadLoRAAdapterRequest(RequestModel):
    lora_name: str
    lora_path: str
    # vLLM's: replace an adapter of this name (its new files get a new id).
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: str
    lora_int_id: int | None = None


def register_lora_modules(
    engine: AsyncLLM, modules: list[tuple[str, str, str | None]] | None, model_names: list[str]
) -> None:
    """Adds the `--lora-modules` adapters (a ValueError names a bad one)."""
    for name, path, base in modules or ():
        if not engine.config.lora_config.enable_lora:
            raise ValueError("--lora-modules: LoRA adapters need --enable-lora")
        if base is not None and base not in model_names:
            raise ValueError(
                f"--lora-modules: base_model_name {base!r} of {name!r} is not a served model "
                f"name ({model_names})"
            )
        engine.loras.add(name, path, tuple(model_names), parent=base)


def lora_for_model(engine: AsyncLLM, model: str | None) -> LoRARequest | None:
    """The adapter a request's `model` names (None for a base model name or no name)."""
    return None if model is None else engine.loras.by_name.get(model)


# vLLM's answer: a line of text; errors are OpenAI's JSON envelope.
_RESPONSES: dict[int | str, dict] = {
    200: {"description": "Done", "content": {"text/plain": {"schema": {"type": "string"}}}},
    **ERROR_RESPONSES,
}


def add_lora_routes(app: FastAPI, engine: AsyncLLM, model_names: list[str]) -> None:
    # Loads and unloads one at a time: a name is checked and taken in one go.
    changing = asyncio.Lock()

    @app.post("/v1/load_lora_adapter", responses=_RESPONSES)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        _check_enabled(engine, "load_lora_adapter")
        try:
            async with changing:  # reads the folder's files: off the event loop
                await asyncio.to_thread(
                    engine.loras.add,
                    body.lora_name,
                    body.lora_path,
                    tuple(model_names),
                    replace=body.load_inplace,
                )
        except FieldError as e:
            raise APIError(400, str(e), param=e.field) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", responses=_RESPONSES)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        _check_enabled(engine, "unload_lora_adapter")
        async with changing:
            known = engine.loras.by_name.get(body.lora_name)
            if known is None or body.lora_int_id not in (None, known.lora_int_id):
                raise APIError(
                    404,
                    f"The LoRA adapter `{body.lora_name}` is not loaded",
                    param="lora_name",
                    code="model_not_found",
                )
            engine.loras.remove(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _check_enabled(engine: AsyncLLM, route: str) -> None:
    if not engine.config.lora_config.enable_lora:
        raise APIError(400, f"{route} needs a server started with --enable-lora")
