"""OpenAI's `response_format` and vLLM's `structured_outputs` field as `StructuredOutputsParams`.
In chat a forced `tool_choice` is a structural tag (`tool_parsers/tool_choice.py`), and with a
reasoning parser the constraint starts after the reasoning: a structural tag whose first element
is the parser's free reasoning block.
"""

from __future__ import annotations

import json
from typing import Any

from ferrum.entrypoints.openai.protocol import (
    JsonObjectResponseFormat,
    JsonSchemaResponseFormat,
    StructuredOutputsRequest,
    TextResponseFormat,
)
from ferrum.sampling_params import StructuredOutputsParams

# Whitespace allowed between the reasoning block and a constrained answer.
_MAX_SEPARATOR_WHITESPACE = 8


def requested_constraint(
    response_format: Any, structured_outputs: StructuredOutputsRequest | None
) -> StructuredOutputsParams | None:
    """The constraint a request asks for, or None; raises ValueError naming the field."""
    if structured_outputs is not None:
        if response_format is not None and not isinstance(response_format, TextResponseFormat):
            raise ValueError(
                "response_format: give response_format or structured_outputs, not both"
            )
        return structured_outputs.to_params()
    if isinstance(response_format, JsonObjectResponseFormat):
        return StructuredOutputsParams(json_object=True)
    if isinstance(response_format, JsonSchemaResponseFormat):
        return StructuredOutputsParams(json=response_format.json_schema.json_schema)
    return None


def structural_tag(format: dict[str, Any]) -> StructuredOutputsParams:
    return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": format})


def as_format(params: StructuredOutputsParams) -> dict[str, Any]:
    """The constraint as one element of a structural tag (xgrammar's format objects)."""
    kind = params.kind
    if kind == "json":
        schema = json.loads(params.json) if isinstance(params.json, str) else params.json
        return {"type": "json_schema", "json_schema": schema}
    if kind == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if kind == "regex":
        return {"type": "regex", "pattern": params.regex}
    if kind == "grammar":
        return {"type": "grammar", "grammar": params.grammar}
    if kind == "choice":
        assert params.choice is not None
        return {
            "type": "or",
            "elements": [{"type": "const_string", "value": c} for c in params.choice],
        }
    tag = params.structural_tag
    tag = json.loads(tag) if isinstance(tag, str) else tag
    if not isinstance(tag, dict) or "format" not in tag:
        raise ValueError(
            "structured_outputs.structural_tag: with a reasoning parser it must be "
            "{'type': 'structural_tag', 'format': ...}"
        )
    return tag["format"]


def after_reasoning(
    params: StructuredOutputsParams, reasoning_format: dict[str, Any]
) -> StructuredOutputsParams:
    """`params` applied after a reasoning block: free reasoning, up to a few blanks, then the
    constrained answer."""
    return structural_tag(
        {
            "type": "sequence",
            "elements": [
                reasoning_format,
                {"type": "regex", "pattern": rf"\s{{0,{_MAX_SEPARATOR_WHITESPACE}}}"},
                as_format(params),
            ],
        }
    )
