"""Field types and schema clauses of the request models, exact as JSON Schema states them: an
integer is 3 or 3.0 (never true or "3"), token ids carry the mark that bounds them by the
served model's vocabulary, lists of text carry their limits (request_limits.py)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field

from ferrum.entrypoints.openai.request_limits import (
    TOKEN_ID_SCHEMA,
    bounded,
)
from ferrum.sampling_params import MAX_LIST_CHARS, MAX_LIST_ITEMS, MAX_LOGIT_BIAS, MAX_LOGPROBS

# Most completions one HTTP request may ask for (n, times the prompts of a batch).
MAX_CHOICES = 128


def implies(condition: dict[str, Any], consequence: dict[str, Any]) -> dict[str, Any]:
    """A JSON-schema clause: when every field of `condition` is present with the given value
    (`NOT_NULL`: any value but null), every field of `consequence` is present with its value."""

    return {
        "if": {"required": list(condition), "properties": _field_values(condition)},
        "then": {"required": list(consequence), "properties": _field_values(consequence)},
    }


def excludes(fields: dict[str, Any]) -> dict[str, Any]:
    """A JSON-schema clause: the fields are not all present with these values together."""
    return {"not": {"required": list(fields), "properties": _field_values(fields)}}


NOT_NULL = object()
# Tags of unions told apart by a function start with this; error locations leave them out.
UNION_TAG = "~"


def _field_values(fields: dict[str, Any]) -> dict[str, Any]:
    return {
        name: {"not": {"type": "null"}} if value is NOT_NULL else {"const": value}
        for name, value in fields.items()
    }


def _integral(value: Any) -> Any:
    """JSON Schema counts 1.0 as an integer; strict validation would refuse it."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


def integer(ge: int | None = None, le: int | None = None, extra: dict | None = None) -> Any:
    """An integer as JSON Schema defines it (3 and 3.0; never true, "3" or 3.5), in [ge, le].
    The bounds sit before the validator so that they reach the schema."""
    return Annotated[int, Field(ge=ge, le=le, json_schema_extra=extra), BeforeValidator(_integral)]


# Published with the served model's vocabulary as its maximum (request_limits.publish_vocab_size).
TokenId = integer(ge=0, extra=TOKEN_ID_SCHEMA)
NonNegativeInt = integer(ge=0)
PositiveInt = integer(ge=1)
NumChoices = integer(ge=1, le=MAX_CHOICES)
NumLogprobs = integer(ge=0, le=MAX_LOGPROBS)
NonEmptyText = Annotated[str, Field(min_length=1)]
NonBlankText = Annotated[str, Field(pattern=r"\S")]
TOKEN_ID_TEXT_PATTERN = r"^(0|[1-9][0-9]{0,9})$"  # as JSON writes an integer
TokenIdText = Annotated[str, Field(pattern=TOKEN_ID_TEXT_PATTERN)]
LogitBias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
ListText = Annotated[str, Field(min_length=1, max_length=MAX_LIST_CHARS)]
TextList = Annotated[list[ListText], *bounded(MAX_LIST_ITEMS, MAX_LIST_CHARS)]
# Token-id lists stop at their first bad item (a huge list of wrong values reports one error).
TokenIds = Annotated[list[TokenId], Field(min_length=1, fail_fast=True)]
