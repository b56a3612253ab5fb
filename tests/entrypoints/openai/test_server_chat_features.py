"""Chat features behind server flags, on one server of this module: a chat template from a file
that renders tools and opens a <think> block, the hermes tool parser with auto tool choice, the
qwen3 reasoning parser, request templates trusted, and CORS for one origin."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ferrum.default_model import DEFAULT_MODEL_NAME
from tests.utils.remote_server import RemoteServer

MODEL = DEFAULT_MODEL_NAME
TEMPLATE = Path(__file__).parent / "templates" / "chatml_tools_thinking.jinja"
ORIGIN = "http://app.example"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    log = tmp_path_factory.mktemp("chat_features") / "server.log"
    remote = RemoteServer(
        [
            "--max-model-len",
            "512",
            "--chat-template",
            str(TEMPLATE),
            "--trust-request-chat-template",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--reasoning-parser",
            "qwen3",
            "--allowed-origins",
            json.dumps([ORIGIN]),
        ],
        log,
    )
    yield remote
    assert remote.stop() == 0, remote.log()


def rendered(server: RemoteServer, body: dict[str, Any]) -> str:
    tokens = httpx.post(server.url + "/tokenize", json=body, timeout=30)
    assert tokens.status_code == 200, tokens.text
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens.json()["tokens"]})
    return text.json()["prompt"]


def test_tools_and_tool_turns_render_through_the_template(chat_server: RemoteServer) -> None:
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    text = rendered(chat_server, {"messages": messages, "tools": [WEATHER_TOOL]})
    assert "<tools>\n" + json.dumps(WEATHER_TOOL) + "\n</tools>" in text
    # The call's JSON arguments reach the template as a dict (rendered back with tojson).
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert text.endswith("assistant\n<think>\n")  # special tokens are not detokenized


def test_request_template_and_template_kwargs(chat_server: RemoteServer) -> None:
    body = {"messages": USER, "chat_template": "{{ messages[0].content }}!{{ flavour }}"}
    assert rendered(chat_server, {**body, "chat_template_kwargs": {"flavour": "?"}}) == (
        USER[0]["content"] + "!?"
    )
    closed = rendered(
        chat_server, {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert closed.endswith("<think>\n\n</think>\n\n")


def test_reasoning_is_split_from_the_answer(chat_server: RemoteServer) -> None:
    client = chat_server.client()
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": USER,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 7,
        "extra_body": {"ignore_eos": True},
    }
    # The template opens <think>: all 8 tokens are reasoning (the tiny model never closes it).
    thinking = client.chat.completions.create(**kwargs).choices[0]
    reasoning = thinking.message.model_extra["reasoning_content"]
    assert reasoning and not thinking.message.content
    streamed = ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            assert not choice.delta.content
            streamed += (choice.delta.model_extra or {}).get("reasoning_content") or ""
    assert streamed == reasoning
    # enable_thinking=false closes the block in the prompt: the same tokens are the answer.
    kwargs["extra_body"] = {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}
    answer = client.chat.completions.create(**kwargs).choices[0]
    assert answer.message.content and answer.message.model_extra["reasoning_content"] is None


def test_auto_tool_choice_is_served(chat_server: RemoteServer) -> None:
    # The tiny model writes no call by itself: the answer is text, the response well formed.
    result = chat_server.client().chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=[WEATHER_TOOL],
        max_tokens=4,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    choice = result.choices[0]
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls


def test_cors_preflight_answers_the_allowed_origin_only(chat_server: RemoteServer) -> None:
    request_headers = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    url = chat_server.url + "/v1/chat/completions"
    allowed = httpx.options(url, headers={"Origin": ORIGIN, **request_headers})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in allowed.headers["access-control-allow-methods"]
    denied = httpx.options(url, headers={"Origin": "http://evil.example", **request_headers})
    assert denied.status_code == 400
    assert "access-control-allow-origin" not in denied.headers
    simple = httpx.get(chat_server.url + "/v1/models", headers={"Origin": ORIGIN})
    assert simple.headers["access-control-allow-origin"] == ORIGIN


def test_tools_xgrammar_cannot_compile_are_free_under_auto_only(chat_server: RemoteServer) -> None:
    """Under "auto" the tools' schemas constrain the calls where xgrammar compiles them; a valid
    schema it cannot compile (a Unicode class) leaves the calls free; a forced call needs it."""
    letters = {"type": "object", "properties": {"w": {"type": "string", "pattern": "^\\p{L}+$"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": letters}}
    body = {"model": MODEL, "messages": USER, "tools": [tool], "max_tokens": 4}
    url = chat_server.url + "/v1/chat/completions"
    response = httpx.post(url, json=body, timeout=60)
    assert response.status_code == 200, response.text
    response = httpx.post(url, json=body | {"tool_choice": "required"}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tool_choice"
