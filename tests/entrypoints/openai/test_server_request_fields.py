"""Every request field works or is a 400 naming it, on the shared server (no tool parser, no
reasoning parser, no request templates; CORS open as vLLM's default)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from ferrum.default_model import DEFAULT_MODEL_NAME
from tests.utils.remote_server import RemoteServer

MODEL = DEFAULT_MODEL_NAME
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def post(server: RemoteServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=60)


def error_of(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    return response.json()["error"]


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        # Unknown fields, vLLM's removed guided_* fields included, are never ignored.
        ("/v1/completions", {"prompt": "x", "guided_json": {}}, "guided_json", "Extra inputs"),
        ("/v1/chat/completions", {"messages": USER, "functions": []}, "functions", "Extra"),
        ("/v1/chat/completions", {"messages": USER, "audio": {}}, "audio", "Extra"),
        # Booleans are not integers.
        ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens", "integer"),
        ("/v1/completions", {"prompt": "x", "top_k": False}, "top_k", "integer"),
        ("/v1/completions", {"prompt": [[False]]}, "prompt", ""),
        ("/v1/completions", {"prompt": "x", "suffix": "!"}, "suffix", ""),
        ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of", "must equal n"),
        (
            "/v1/completions",
            {"prompt": "x", "stream": True, "prompt_logprobs": 1},
            "prompt_logprobs",
            "stream=true",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "stream": True, "prompt_logprobs": 0},
            "prompt_logprobs",
            "stream=true",
        ),
        # Tools need the server's flags for "auto" (the default once tools are given).
        (
            "/v1/chat/completions",
            {"messages": USER, "tools": [TOOL]},
            "tool_choice",
            "--enable-auto-tool-choice",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": USER,
                "tools": [TOOL],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
            "not in tools",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "chat_template": "{{ messages }}"},
            "chat_template",
            "--trust-request-chat-template",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "chat_template_kwargs": {"tools": []}},
            "chat_template_kwargs",
            "may not set",
        ),
        ("/tokenize", {"messages": []}, "messages", ""),
        ("/tokenize", {"prompt": "x", "messages": USER}, None, ""),
    ],
)
def test_field_errors_name_the_field(
    server: RemoteServer, path: str, body: dict[str, Any], param: str | None, words: str
) -> None:
    error = error_of(post(server, path, body))
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error
    assert words in error["message"]


def test_fields_with_no_effect_are_accepted(server: RemoteServer) -> None:
    client = server.client()
    chat = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=2,
        user="u-1",
        store=False,
        metadata={"team": "a"},
        service_tier="auto",
        extra_body={"prompt_cache_key": "k", "safety_identifier": "s"},
    )
    assert chat.choices[0].message.content is not None
    completion = client.completions.create(
        model=MODEL, prompt="x", max_tokens=2, user="u-1", best_of=1, suffix=""
    )
    assert completion.choices[0].text is not None


def test_tool_choice_none_renders_tools_and_answers_in_text(server: RemoteServer) -> None:
    result = server.client().chat.completions.create(
        model=MODEL, messages=USER, tools=[TOOL], tool_choice="none", max_tokens=3
    )
    assert result.choices[0].message.tool_calls in (None, [])
    assert result.choices[0].message.content is not None


def test_tool_turns_are_accepted(server: RemoteServer) -> None:
    messages = [
        *USER,
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    result = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert result.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        server.client().chat.completions.create(
            model=MODEL, messages=[*USER, {"role": "tool", "content": "x"}], max_tokens=2
        )


def test_cors_preflight_is_answered_before_the_api_key(server: RemoteServer) -> None:
    response = httpx.options(
        server.url + "/v1/chat/completions",
        headers={
            "Origin": "http://localhost:3000",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "*"
