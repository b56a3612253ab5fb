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


def test_tokenize_returns_token_strings(server: RemoteServer) -> None:
    for body in (
        {"prompt": "Hello world"},
        {"messages": [{"role": "user", "content": "Hello world"}]},
    ):
        response = httpx.post(
            server.url + "/tokenize",
            json=body | {"return_token_strs": True},
            headers=server.headers,
            timeout=30,
        ).json()
        assert len(response["token_strs"]) == response["count"] > 0
        assert all(isinstance(s, str) and s for s in response["token_strs"])
        plain = httpx.post(server.url + "/tokenize", json=body, headers=server.headers, timeout=30)
        assert plain.json()["token_strs"] is None
    response = httpx.post(
        server.url + "/tokenize",
        json={"prompt": "Hello world", "return_token_strs": True},
        headers=server.headers,
        timeout=30,
    ).json()
    assert response["token_strs"] == ["H", "ell", "o", "Ġworld"]  # the tiny vocabulary


def test_continuous_usage_stats_put_usage_in_every_chunk(server: RemoteServer) -> None:
    stream = server.client().completions.create(
        model=DEFAULT_MODEL_NAME,
        prompt="Once upon a time",
        max_tokens=5,
        stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    chunks = list(stream)
    assert all(chunk.usage is not None for chunk in chunks)
    completion_tokens = [chunk.usage.completion_tokens for chunk in chunks]
    assert completion_tokens == sorted(completion_tokens) and completion_tokens[-1] == 5
    assert chunks[-1].choices == [] and chunks[0].usage.prompt_tokens == 4
    assert all(
        c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks
    )


def test_continuous_usage_stats_in_chat_streams(server: RemoteServer) -> None:
    stream = server.client().chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    chunks = list(stream)
    content_chunks = [c for c in chunks[1:] if c.choices]  # after the role chunk
    assert content_chunks and all(c.usage is not None for c in content_chunks)
    assert [c.usage.completion_tokens for c in content_chunks][-1] == 4
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].choices == []
