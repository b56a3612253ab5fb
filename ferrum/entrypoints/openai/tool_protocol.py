"""Pydantic models of the tools a chat request offers (functions with a JSON-schema `parameters`,
nested at most MAX_JSON_DEPTH levels) and of `tool_choice`, which may only name one of them.
Validation rules are those of protocol.py (strict, unknown fields are errors)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationInfo

from ferrum.entrypoints.openai.protocol import RequestModel
from ferrum.entrypoints.openai.request_limits import ShallowObject

# OpenAI's rule for function names; it also keeps names safe inside the tool-call tags.
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(RequestModel):
    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
    description: str | None = None
    parameters: ShallowObject | None = None
    # Calls forced by tool_choice ("required" or a named function) always match `parameters`;
    # "auto" calls are parsed from free output whatever `strict` says.
    strict: bool | None = None


class ChatCompletionTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def check_named_tool(value: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
    """A tool_choice naming a function names one of `tools`."""
    if isinstance(value, NamedToolChoice):
        names = [tool.function.name for tool in info.data.get("tools") or ()]
        if value.function.name not in names:
            raise ValueError(
                f"tool_choice names function {value.function.name!r}, which is not in tools "
                f"({', '.join(names) or 'none given'})"
            )
    return value
