"""Pydantic models of the OpenAI-compatible API shared by every endpoint: errors, the sampling
fields of completions and chat (OpenAI's names plus vLLM's extensions), /v1/completions and
/tokenize (chat's own models: chat_protocol.py; responses: responses.py). Validation is strict
and the OpenAPI schema comes from these models: an unknown field is a 400 naming it, a boolean is
not an integer. OpenAI fields with no effect on a local model are `NO_EFFECT_FIELDS`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ferrum.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    SamplingParams,
    StructuredOutputsParams,
)

# Most completions one HTTP request may ask for (n, times the prompts of a batch).
MAX_CHOICES = 128
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

# Accepted for compatibility with OpenAI clients; they do not change what the server does.
NO_EFFECT_FIELDS = (
    "user",
    "store",
    "metadata",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
)


class OpenAIModel(BaseModel):
    # NaN and infinities are invalid; responses tolerate fields added by later versions.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class RequestModel(BaseModel):
    """A request body (or part of one): unknown fields are errors, types are strict (a boolean
    is not an integer, a number is not a string), NaN and infinities are invalid."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


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


# -- requests --------------------------------------------------------------------------------------


def _integral(value: Any) -> Any:
    """JSON Schema counts 1.0 as an integer; strict validation would refuse it."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


def integer(ge: int | None = None, le: int | None = None) -> Any:
    """An integer as JSON Schema defines it (3 and 3.0; never true, "3" or 3.5), in [ge, le].
    The bounds sit before the validator so that they reach the schema."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral)]


TokenId = integer(ge=0)
NonNegativeInt = integer(ge=0)
PositiveInt = integer(ge=1)
NumChoices = integer(ge=1, le=MAX_CHOICES)
NumLogprobs = integer(ge=0, le=MAX_LOGPROBS)
NonEmptyText = Annotated[str, Field(min_length=1)]
NonBlankText = Annotated[str, Field(pattern=r"\S")]
TOKEN_ID_TEXT_PATTERN = r"^[0-9]{1,10}$"
TokenIdText = Annotated[str, Field(pattern=TOKEN_ID_TEXT_PATTERN)]
LogitBias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]


# -- constrained output --


class JsonSchemaFormat(RequestModel):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    # The output always matches `schema` (OpenAI's strict mode is how it works here).
    strict: bool | None = None


class TextResponseFormat(RequestModel):
    type: Literal["text"]


class JsonObjectResponseFormat(RequestModel):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(RequestModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    TextResponseFormat | JsonObjectResponseFormat | JsonSchemaResponseFormat,
    Field(discriminator="type"),
]


def _exactly_one_field(schema: dict[str, Any]) -> None:
    schema["minProperties"] = 1
    schema["maxProperties"] = 1
    for prop in schema.get("properties", {}).values():
        options = prop.pop("anyOf", None)
        if options is not None:
            prop.update(next(o for o in options if o.get("type") != "null"))
        prop.pop("default", None)


class StructuredOutputsRequest(RequestModel):
    """vLLM's `structured_outputs` body field: exactly one kind of constraint."""

    model_config = ConfigDict(json_schema_extra=_exactly_one_field)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: NonEmptyText | None = None
    choice: Annotated[list[NonEmptyText], Field(min_length=1)] | None = None
    grammar: NonEmptyText | None = None
    json_object: Literal[True] | None = None
    structural_tag: dict[str, Any] | str | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_kind(cls, data: Any) -> Any:
        if isinstance(data, dict) and (len(data) != 1 or None in data.values()):
            raise ValueError(
                "give exactly one of json, regex, choice, grammar, json_object, structural_tag"
            )
        return data

    def to_params(self) -> StructuredOutputsParams:
        """Raises ValueError unless exactly one kind is set (and well formed)."""
        return StructuredOutputsParams(
            json=self.json_,
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            json_object=self.json_object,
            structural_tag=self.structural_tag,
        )


class StreamOptions(RequestModel):
    include_usage: bool | None = False


NO_STREAMED_PROMPT_LOGPROBS = excludes({"stream": True, "prompt_logprobs": NOT_NULL})
# response_format (other than "text") and structured_outputs are two ways to ask for one thing.
ONE_OUTPUT_CONSTRAINT = {
    "not": {
        "required": ["response_format", "structured_outputs"],
        "properties": {
            "structured_outputs": {"not": {"type": "null"}},
            "response_format": {
                "not": {"type": "null"},
                "properties": {"type": {"not": {"const": "text"}}},
            },
        },
    }
}


class SamplingRequest(RequestModel):
    """Fields shared by completions and chat completions. None means "the model's default"
    (generation_config.json), then OpenAI's."""

    model: str | None = None
    n: NumChoices = 1
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: integer(ge=-1) | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    seed: integer(ge=_INT64_MIN, le=_INT64_MAX) | None = None
    stop: NonEmptyText | list[NonEmptyText] | None = None
    stop_token_ids: list[TokenId] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: NonNegativeInt = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI: token id (as text) -> bias added to its logit, in [-100, 100].
    logit_bias: dict[TokenIdText, LogitBias] | None = Field(
        None, json_schema_extra={"propertyNames": {"pattern": TOKEN_ID_TEXT_PATTERN}}
    )
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    bad_words: list[NonBlankText] | None = None
    # vLLM's extension: per prompt token, its logprob and the top-k (not with stream=true).
    prompt_logprobs: NumLogprobs | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # No effect (see NO_EFFECT_FIELDS).
    user: str | None = None

    def to_sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        defaults: dict[str, Any],
        structured_outputs: StructuredOutputsParams | None,
    ) -> SamplingParams:
        """Request fields first, then `defaults` (the model's generation config), then
        SamplingParams' own; raises ValueError (400) naming the field. `structured_outputs` is
        the constraint the caller derived from this request (see structured_outputs.py)."""

        def pick(name: str) -> Any:
            value = getattr(self, name)
            return defaults.get(name) if value is None else value

        values = {
            name: pick(name)
            for name in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
            )
        }
        return SamplingParams(
            n=self.n,
            **{name: value for name, value in values.items() if value is not None},
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=(
                None
                if self.logit_bias is None
                else {int(token): bias for token, bias in self.logit_bias.items()}
            ),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            structured_outputs=structured_outputs,
            prompt_logprobs=self.prompt_logprobs,
        )

    @field_validator("structured_outputs")
    @classmethod
    def _one_output_constraint(
        cls, value: StructuredOutputsRequest | None, info: ValidationInfo
    ) -> StructuredOutputsRequest | None:
        response_format = info.data.get("response_format")
        if value is not None and not isinstance(response_format, TextResponseFormat | None):
            raise ValueError("give response_format or structured_outputs, not both")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _no_prompt_logprobs_in_streams(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs are not available with stream=true")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    model_config = ConfigDict(
        json_schema_extra={"allOf": [NO_STREAMED_PROMPT_LOGPROBS, ONE_OUTPUT_CONSTRAINT]}
    )

    prompt: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    max_tokens: PositiveInt | None = 16
    echo: bool = False
    logprobs: NumLogprobs | None = None
    # Ranking several candidates per choice is not supported: best_of must equal n.
    best_of: NumChoices | None = None
    # Fill-in-the-middle is not supported: the only suffix accepted is the empty one.
    suffix: Literal[""] | None = None

    # Cross-field rules are field validators (the error names the field); fields are
    # validated in declaration order, so `info.data` holds the ones above.
    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value != n:
            raise ValueError(
                f"best_of ({value}) must equal n ({n}): ranking candidates by likelihood is "
                "not supported"
            )
        return value


class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]
