"""Issue 36 against the live server: valid JSON nested hundreds of levels is a 400 naming the
field (was a RecursionError 500); lists far past their limits are refused up front; requests
right at the limits are served while another user's stream keeps flowing; HEAD /health; the
schema's promises (stream_options needs stream, tool_choice names a tool, no-effect fields)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from ferrum.default_model import DEFAULT_MODEL_NAME
from ferrum.sampling_params import MAX_LIST_ITEMS
from tests.utils.remote_server import RemoteServer

MESSAGES = [{"role": "user", "content": "hi"}]


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def post(server: RemoteServer, path: str, body: Any, timeout: float = 120) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**server.headers, "Content-Type": "application/json"}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=timeout)


def call(arguments: str) -> dict[str, Any]:
    function = {"name": "f", "arguments": arguments}
    return {
        "role": "assistant",
        "tool_calls": [{"id": "1", "type": "function", "function": function}],
    }


# The inputs that were 500s (RecursionError), each with the field its 400 names.
DEEP = [
    ("/v1/chat/completions", {"chat_template_kwargs": {"x": nested(490)}}, "chat_template_kwargs"),
    (
        "/v1/chat/completions",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": nested(300)}}]},
        "tools.0.function.parameters",
    ),
    (
        "/v1/chat/completions",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": nested(300)},
            }
        },
        "response_format.json_schema.json_schema.schema",
    ),
    ("/v1/completions", {"structured_outputs": {"json": nested(300)}}, "structured_outputs.json"),
    (
        "/v1/chat/completions",
        {"messages": [*MESSAGES, call(json.dumps(nested(900)))]},
        "messages.1.assistant.tool_calls.0.function.arguments",
    ),
    ("/tokenize", {"chat_template_kwargs": {"x": nested(490)}}, "chat_template_kwargs"),
]


@pytest.mark.parametrize(("path", "fields", "param"), DEEP)
def test_deep_json_is_a_400_naming_the_field(
    server: RemoteServer, path: str, fields: dict[str, Any], param: str
) -> None:
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": MESSAGES}
    response = post(
        server,
        path,
        {**base, "max_tokens": 2, **fields} if path != "/tokenize" else {**base, **fields},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "nests deeper than 64 levels" in error["message"]


def _stream_gaps(server: RemoteServer, gaps: list[float], finishes: list[str]) -> None:
    body = {"model": DEFAULT_MODEL_NAME, "prompt": "Once", "max_tokens": 48, "ignore_eos": True}
    body["stream"] = True
    last = None
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, headers=server.headers, timeout=120
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
                finish = json.loads(line.removeprefix("data: "))["choices"][0]["finish_reason"]
                if finish is not None:
                    finishes.append(finish)


def test_hostile_requests_cost_another_stream_little(server: RemoteServer) -> None:
    """Bodies past the limits are refused before their items are walked; requests at the limits
    (the most stop strings, bad words and choices) are served beside a running stream, which
    finishes whole. Its token gaps are measured by benchmarks/soak_server.py --hostile
    (benchmarks/RESULTS.md), not here."""
    huge = {
        "stop": [f"s{i:07d}" for i in range(1_000_000)],  # 13 MB, the 8.4 s stall
        "bad_words": [f"w{i}" for i in range(300_000)],
        "structured_outputs": {"choice": [f"c{i}" for i in range(100_000)]},
    }
    raw = {name: json.dumps({"prompt": "hi", name: value}).encode() for name, value in huge.items()}
    at_limits = {
        "stop": [f"{i:015d}x" for i in range(MAX_LIST_ITEMS)],
        "bad_words": [f"word{i:011d}" for i in range(MAX_LIST_ITEMS)],
        "structured_outputs": {"choice": [f"option{i:09d}" for i in range(MAX_LIST_ITEMS)]},
    }
    gaps: list[float] = []
    finishes: list[str] = []
    stream = threading.Thread(target=_stream_gaps, args=(server, gaps, finishes))
    stream.start()
    time.sleep(0.5)
    for name, body in raw.items():
        response = post(server, "/v1/completions", body)
        assert response.status_code == 400 and response.json()["error"]["param"].startswith(name)
        assert f"the limit is {MAX_LIST_ITEMS}" in response.text
    for name, value in at_limits.items():
        body = {
            "prompt": "hi",
            "max_tokens": 16,
            "ignore_eos": name != "structured_outputs",
            name: value,
        }
        assert post(server, "/v1/completions", body).status_code == 200
    stream.join(120)
    assert finishes == ["length"]  # all its 48 tokens, whatever the chunks merged


def test_head_health_answers_like_get(server: RemoteServer) -> None:
    response = httpx.head(server.url + "/health", timeout=10)
    assert response.status_code == 200 and response.content == b""


def test_request_fields_behave_as_the_schema_says(server: RemoteServer) -> None:
    no_effect = {"store": True, "metadata": {"k": "v"}, "service_tier": "auto"}
    no_effect |= {"prompt_cache_key": "k", "safety_identifier": "s", "user": "u"}
    assert (
        post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **no_effect}).status_code
        == 200
    )
    for path, base in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
    ):
        response = post(server, path, {**base, "stream_options": {"include_usage": True}})
        assert response.status_code == 400 and response.json()["error"]["param"] == "stream_options"
    tools = [{"type": "function", "function": {"name": "f"}}]
    named = {"type": "function", "function": {"name": "g"}}
    response = post(
        server, "/v1/chat/completions", {"messages": MESSAGES, "tools": tools, "tool_choice": named}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    openapi = httpx.get(server.url + "/openapi.json", headers=server.headers, timeout=10).json()
    schema = openapi["components"]["schemas"]
    assert (
        "--trust-request-chat-template"
        in schema["TokenizeChatRequest"]["properties"]["chat_template"]["description"]
    )
