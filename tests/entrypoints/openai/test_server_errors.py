"""Every client error comes back with its status in OpenAI's error envelope, and stays short."""

from __future__ import annotations

import re
from typing import Any

import httpx
import openai
import pytest

from ferrum.default_model import DEFAULT_MODEL_NAME
from tests.utils.remote_server import RemoteServer


def post(server: RemoteServer, path: str, **kwargs: Any) -> httpx.Response:
    headers = {**server.headers, **kwargs.pop("headers", {})}
    return httpx.post(server.url + path, headers=headers, timeout=30, **kwargs)


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert len(response.content) < 1000
    return error


def test_invalid_json_is_400(server: RemoteServer) -> None:
    response = post(
        server,
        "/v1/completions",
        content=b'{"prompt": "x",',
        headers={"Content-Type": "application/json"},
    )
    error = error_of(response, 400)
    assert error["type"] == "invalid_request_error"
    assert error_of(
        post(
            server,
            "/v1/completions",
            content=b"[1, 2]",
            headers={"Content-Type": "application/json"},
        ),
        400,
    )


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/completions", {"prompt": [], "max_tokens": 3}, None),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, None),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
        ),
        ("/v1/completions", {"prompt": [99999999]}, "prompt"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1.0}}, "logit_bias"),
        ("/detokenize", {"tokens": [-1]}, None),
        ("/tokenize", {}, "prompt"),
    ],
)
def test_invalid_fields_are_400(
    server: RemoteServer, path: str, body: dict[str, Any], param: str | None
) -> None:
    error = error_of(post(server, path, json=body), 400)
    if param is not None:
        assert error["param"] is not None and param in error["param"]


def test_context_overflow_names_both_numbers(server: RemoteServer) -> None:
    prompt = "hello " * 100
    num_prompt = len(post(server, "/tokenize", json={"prompt": prompt}).json()["tokens"])
    error = error_of(
        post(server, "/v1/completions", json={"prompt": prompt, "max_tokens": 500}), 400
    )
    assert f"({num_prompt} tokens)" in error["message"] and "(500)" in error["message"]
    assert "max_model_len=512" in error["message"]
    chat = post(
        server,
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 1000},
    )
    assert "(1000)" in error_of(chat, 400)["message"]


def test_huge_inputs_are_not_echoed(server: RemoteServer) -> None:
    huge = "zq" * 50_000
    error_of(post(server, "/v1/completions", json={"prompt": huge, "max_tokens": 8}), 400)
    error_of(post(server, "/v1/completions", json={"prompt": "x", "stop": {"k": huge}}), 400)
    error_of(post(server, "/v1/chat/completions", json={"messages": [{"role": huge}]}), 400)


def test_unknown_model_is_404(server: RemoteServer) -> None:
    response = post(server, "/v1/completions", json={"model": "gpt-17", "prompt": "x"})
    error = error_of(response, 404)
    assert error["code"] == "model_not_found" and "gpt-17" in error["message"]
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}]
        )


def test_api_key_is_required_on_v1(server: RemoteServer) -> None:
    body = {"model": DEFAULT_MODEL_NAME, "prompt": "x", "max_tokens": 1}
    missing = httpx.post(server.url + "/v1/completions", json=body, timeout=10)
    assert error_of(missing, 401)["code"] == "invalid_api_key"
    wrong = httpx.post(
        server.url + "/v1/models", timeout=10.0, headers={"Authorization": "Bearer wrong"}
    )
    assert wrong.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()
    # Health and metrics stay open for probes.
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_unknown_route_uses_envelope(server: RemoteServer) -> None:
    response = httpx.get(server.url + "/v2/nothing", timeout=10)
    error_of(response, 404)
    assert re.search("not found", response.json()["error"]["message"], re.IGNORECASE)
