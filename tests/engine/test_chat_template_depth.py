"""Inputs nested past Python's recursion limit make rendering a ValueError (a 400 at the server),
never a RecursionError; inputs at the request limit (64 levels) render."""

from __future__ import annotations

from typing import Any

import pytest

from ferrum.engine.chat_template import ChatTemplateRenderer
from ferrum.sampling_params import MAX_JSON_DEPTH

TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}{{ extra | tojson }}"


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth - 1):
        value = {"a": value}
    return value


@pytest.mark.parametrize("place", ["template_vars", "tools", "message"])
def test_deep_input_is_a_value_error(place: str) -> None:
    deep = nested(5000)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    kwargs: dict[str, Any] = {"template_vars": {"extra": 1}}
    if place == "template_vars":
        kwargs["template_vars"] = {"extra": deep}
    elif place == "tools":
        kwargs["tools"] = [{"type": "function", "function": {"name": "f", "parameters": deep}}]
    else:
        messages[0]["tool_calls"] = [{"function": {"name": "f", "arguments": deep}}]
    with pytest.raises(ValueError, match="nests too deeply"):
        ChatTemplateRenderer().render(TEMPLATE, messages, add_generation_prompt=False, **kwargs)


def test_input_at_the_request_limit_renders() -> None:
    rendered = ChatTemplateRenderer().render(
        TEMPLATE,
        [{"role": "user", "content": "hi"}],
        add_generation_prompt=False,
        template_vars={"extra": nested(MAX_JSON_DEPTH)},
    )
    assert rendered.startswith("hi{") and rendered.count("{") == MAX_JSON_DEPTH - 1
