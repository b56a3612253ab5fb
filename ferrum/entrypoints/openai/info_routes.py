"""Routes a client probes besides generation: OpenAI's `GET /v1/models` and `GET
/v1/models/{model}`, vLLM's `/ping` (GET and POST: 200 when healthy, 503 like /health otherwise)
and `GET /load` (requests in flight)."""

from __future__ import annotations

import time

from fastapi import FastAPI

from ferrum.engine.async_llm import AsyncLLM
from ferrum.entrypoints.openai.http_errors import ERROR_RESPONSES, APIError
from ferrum.entrypoints.openai.protocol import OpenAIModel
from ferrum.entrypoints.openai.responses import HealthResponse, ModelCard, ModelList


class ServerLoad(OpenAIModel):
    # Requests the server holds: queued, running, or waiting for their grammar.
    server_load: int


def add_info_routes(app: FastAPI, engine: AsyncLLM, model_names: list[str]) -> None:
    created = int(time.time())
    root = engine.config.model_config.model
    max_model_len = engine.config.model_config.max_model_len
    cards = {
        name: ModelCard(id=name, created=created, root=root, max_model_len=max_model_len)
        for name in model_names
    }

    def all_cards() -> dict[str, ModelCard]:
        """The base model's names, then the LoRA adapters loaded now (parent: the base)."""
        adapters = {
            name: ModelCard(
                id=name,
                created=created,
                root=lora.lora_path,
                parent=engine.loras.parents.get(name) or model_names[0],
                max_model_len=max_model_len,
            )
            for name, lora in engine.loras.by_name.items()
        }
        return cards | adapters

    @app.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
    async def list_models() -> ModelList:
        return ModelList(data=list(all_cards().values()))

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=ERROR_RESPONSES)
    async def retrieve_model(model: str) -> ModelCard:
        served = all_cards()
        card = served.get(model)
        if card is None:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves {list(served)}",
                param="model",
                code="model_not_found",
            )
        return card

    async def ping() -> HealthResponse:
        problem = engine.health_problem()
        if problem is not None:
            code, message = problem
            raise APIError(503, message, code=code)
        return HealthResponse()

    app.add_api_route("/ping", ping, response_model=HealthResponse, responses=ERROR_RESPONSES)
    # POST (SageMaker's probe) takes no body: the same route, documented once.
    app.add_api_route("/ping", ping, methods=["POST"], include_in_schema=False)

    @app.get("/load", response_model=ServerLoad)
    async def load() -> ServerLoad:
        return ServerLoad(server_load=engine.num_open_requests)
