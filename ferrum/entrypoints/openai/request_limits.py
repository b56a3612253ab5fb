"""Bounds on what one request body may hold, checked while it is validated and before anything
walks it: list fields (items and characters; SamplingParams' bounds plus the HTTP-only ones),
JSON nesting (`MAX_JSON_DEPTH`, measured without recursion), and the model's vocabulary as the
published upper bound of every token id. Each refusal is a 400 naming the field and the limit.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import FastAPI
from pydantic import BeforeValidator, Field

from ferrum.sampling_params import MAX_JSON_DEPTH, json_depth_exceeds

# OpenAI's limit on tools (functions) per request.
MAX_TOOLS = 128
# Messages, and content parts plus tool calls over all messages: validating them runs on the event
# loop at a few microseconds each, so 4096 of each stays within tens of milliseconds.
MAX_MESSAGES = 4096
MAX_MESSAGE_ITEMS = 4096
# OpenAI's limits on `metadata`: 16 pairs, keys of 64 characters, values of 512.
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
# Schema keys marking token ids, bounded by the served model's vocabulary (`publish_vocab_size`).
_TOKEN_ID = "x-token-id"
_TOKEN_ID_TEXT = "x-token-id-text"
TOKEN_ID_SCHEMA = {_TOKEN_ID: True}
TOKEN_ID_TEXT_SCHEMA = {_TOKEN_ID_TEXT: True}


def within(max_items: int, max_chars: int | None = None) -> BeforeValidator:
    """Checks a list (or dict) holds at most `max_items` items (and `max_chars` characters of
    text in all) before its items are validated."""

    def check(value: Any) -> Any:
        if isinstance(value, list | dict) and len(value) > max_items:
            raise ValueError(f"holds {len(value)} items; the limit is {max_items}")
        if max_chars is not None and isinstance(value, list):
            num_chars = sum(len(v) for v in value if isinstance(v, str))
            if num_chars > max_chars:
                raise ValueError(f"holds {num_chars} characters in all; the limit is {max_chars}")
        return value

    return BeforeValidator(check)


def bounded(max_items: int, max_chars: int | None = None) -> tuple[Any, BeforeValidator]:
    """`within`, plus `maxItems` in the published schema."""
    return Field(max_length=max_items), within(max_items, max_chars)


_TOO_DEEP = f"nests deeper than {MAX_JSON_DEPTH} levels (the limit of JSON values)"


def _shallow(value: Any) -> Any:
    if json_depth_exceeds(value):
        raise ValueError(_TOO_DEEP)
    return value


def _shallow_text(text: Any) -> Any:
    """JSON text nested deeper than MAX_JSON_DEPTH is an error; text that is not JSON passes
    (it reaches chat templates as text)."""
    if not isinstance(text, str) or text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return text
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(_TOO_DEEP) from None
    except ValueError:
        return text
    _shallow(value)
    return text


# A JSON object of any content, nested at most MAX_JSON_DEPTH levels.
ShallowObject = Annotated[dict[str, Any], BeforeValidator(_shallow)]
# JSON text nested at most MAX_JSON_DEPTH levels, or text that is not JSON.
ShallowJSONText = Annotated[str, BeforeValidator(_shallow_text)]
# Either (checked before the union is, so that its error names the field alone).
ShallowObjectOrText = Annotated[
    dict[str, Any] | str,
    BeforeValidator(lambda v: _shallow_text(v) if isinstance(v, str) else _shallow(v)),
]


def conversation_within_limits(messages: Any) -> Any:
    """Messages (and their content parts and tool calls) counted before they are validated."""
    if not isinstance(messages, list):
        return messages
    if len(messages) > MAX_MESSAGES:
        raise ValueError(f"holds {len(messages)} messages; the limit is {MAX_MESSAGES}")
    num_items = 0
    for message in messages:
        if isinstance(message, dict):
            for key in ("content", "tool_calls"):
                items = message.get(key)
                num_items += len(items) if isinstance(items, list) else 0
    if num_items > MAX_MESSAGE_ITEMS:
        raise ValueError(
            f"holds {num_items} content parts and tool calls in all; the limit is "
            f"{MAX_MESSAGE_ITEMS}"
        )
    return messages


# -- the vocabulary in the published schema ------------------------------------------------------


def at_most_pattern(m: int) -> str:
    """A regex of the decimal integers in [0, m] as JSON writes them (no leading zeros)."""
    digits = str(m)
    size = len(digits)
    if size == 1:
        return f"^[0-{m}]$"
    options = ["[0-9]"] + ([f"[1-9][0-9]{{1,{size - 2}}}"] if size > 2 else [])
    for i, digit in enumerate(digits):
        low = 1 if i == 0 else 0
        if int(digit) > low:
            rest = f"[0-9]{{{size - i - 1}}}" if i < size - 1 else ""
            options.append(f"{digits[:i]}[{low}-{int(digit) - 1}]{rest}")
    options.append(digits)
    return "^(" + "|".join(options) + ")$"


def bound_token_ids(schema: Any, vocab_size: int) -> None:
    """Sets the vocabulary's bound on every token id of an OpenAPI schema, in place."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.pop(_TOKEN_ID, False):
                node["maximum"] = vocab_size - 1
            if node.pop(_TOKEN_ID_TEXT, False):
                node["pattern"] = at_most_pattern(vocab_size - 1)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def publish_vocab_size(app: FastAPI, vocab_size: int) -> None:
    """Makes `app`'s OpenAPI schema bound token ids by the served model's vocabulary (a request
    beyond it is a 400 at run time: the request models know no model)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        schema = build()
        bound_token_ids(schema, vocab_size)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
