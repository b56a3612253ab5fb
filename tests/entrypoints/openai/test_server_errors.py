"""Every client error comes back with its status in OpenAI's error envelope, and stays short."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest

from ferrum.default_model import DEFAULT_MODEL_NAME
from tests.utils.remote_server import API_KEY, RemoteServer


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
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101.0}}, "logit_bias"),
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


def test_api_key_is_required_everywhere_but_probes(server: RemoteServer) -> None:
    body = {"model": DEFAULT_MODEL_NAME, "prompt": "x", "max_tokens": 1}
    missing = httpx.post(server.url + "/v1/completions", json=body, timeout=10)
    assert error_of(missing, 401)["code"] == "invalid_api_key"
    wrong = httpx.post(
        server.url + "/v1/models", timeout=10.0, headers={"Authorization": "Bearer wrong"}
    )
    assert wrong.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()
    for method, path, payload in (
        ("POST", "/tokenize", {"prompt": "x"}),
        ("POST", "/detokenize", {"tokens": [1]}),
        ("GET", "/metrics", None),
        ("GET", "/v1/models", None),
        ("GET", "/v2/nothing", None),
    ):
        response = httpx.request(method, server.url + path, json=payload, timeout=10)
        assert error_of(response, 401)["code"] == "invalid_api_key", path
        authorized = httpx.request(
            method, server.url + path, json=payload, headers=server.headers, timeout=10
        )
        assert authorized.status_code != 401, path
    # Probes stay open; the scheme is case-insensitive, extra spaces before the key are ignored.
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/version", timeout=10).status_code == 200
    for authorization in (f"bearer {API_KEY}", f"BEARER  {API_KEY}"):
        headers = {"Authorization": authorization}
        assert httpx.get(server.url + "/v1/models", headers=headers, timeout=10).status_code == 200
    for authorization in (API_KEY, f"Basic {API_KEY}", f"Bearer {API_KEY}x", "Bearer"):
        headers = {"Authorization": authorization}
        assert httpx.get(server.url + "/v1/models", headers=headers, timeout=10).status_code == 401


# JSON can carry lone surrogates (as escapes); UTF-8 and tokenizers cannot.
_USER = {"role": "user", "content": "hi"}
LONE_SURROGATE_CASES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x \udfff y"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "\ud800"}, _USER]}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}]},
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "\udfff"}], "stream": True},
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": "\ud800"}]}),
    ("/v1/chat/completions", {"messages": [_USER], "model": "\ud800"}),
    ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 1}),
    ("/v1/completions", {"prompt": ["ok", "a\ud800b"], "max_tokens": 1}),
    ("/v1/completions", {"prompt": "x", "model": "\ud800"}),
    ("/v1/completions", {"prompt": "x", "stream": True, "model": "\udbff\udbff"}),
    ("/tokenize", {"prompt": "a\ud800b"}),
    ("/tokenize", {"messages": [{"role": "user", "content": "\udfff"}]}),
    ("/tokenize", {"prompt": "x", "model": "\ud800"}),
    ("/detokenize", {"tokens": [1], "model": "\ud800"}),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"\ud800": 1}}),
]


@pytest.mark.parametrize(("path", "body"), LONE_SURROGATE_CASES)
def test_lone_surrogates_are_400(server: RemoteServer, path: str, body: dict[str, Any]) -> None:
    content = json.dumps(body)  # ensure_ascii: each lone surrogate as its escape
    response = post(server, path, content=content, headers={"Content-Type": "application/json"})
    error_of(response, 400)
    response.content.decode("utf-8")  # the error itself is valid UTF-8


def test_unknown_route_uses_envelope(server: RemoteServer) -> None:
    response = httpx.get(server.url + "/v2/nothing", headers=server.headers, timeout=10)
    error_of(response, 404)
    assert re.search("not found", response.json()["error"]["message"], re.IGNORECASE)
