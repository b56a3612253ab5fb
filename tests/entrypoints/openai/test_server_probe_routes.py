"""Routes clients probe, on the shared live server: OpenAI's model retrieval
(`client.models.retrieve`), vLLM's /ping and /load."""

from __future__ import annotations

import httpx
import openai
import pytest

from ferrum.default_model import DEFAULT_MODEL_NAME
from tests.utils.remote_server import RemoteServer


def test_models_retrieve(server: RemoteServer) -> None:
    client = server.client()
    model = client.models.retrieve(DEFAULT_MODEL_NAME)
    assert (model.id, model.object, model.owned_by) == (DEFAULT_MODEL_NAME, "model", "ferrum")
    assert model.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as error:
        client.models.retrieve("no/such-model")
    body = error.value.response.json()["error"]
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert "`no/such-model` does not exist" in body["message"]


def test_ping_answers_like_health_without_the_key(server: RemoteServer) -> None:
    for method in ("GET", "POST"):
        response = httpx.request(method, server.url + "/ping", timeout=10)
        assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_load_counts_requests_in_flight(server: RemoteServer) -> None:
    assert httpx.get(server.url + "/load", timeout=10).status_code == 401  # reveals traffic
    response = httpx.get(server.url + "/load", headers=server.headers, timeout=10)
    assert response.status_code == 200
    assert response.json()["server_load"] >= 0
