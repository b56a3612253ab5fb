"""Pydantic models of the OpenAI-compatible API shared by every endpoint: errors, the sampling
fields of completions and chat (OpenAI's names plus vLLM's extensions), /v1/completions and
/tokenize (chat's own models: chat_protocol.py; responses: responses.py). Validation is strict
and the OpenAPI schema comes from these models: an unknown field is a 400 naming it, a boolean is
not an integer. OpenAI fields with no effect on a local model are `NO_EFFECT_FIELDS`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ferrum.entrypoints.openai.request_limits import (
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_CHARS,
    TOKEN_ID_TEXT_SCHEMA,
    ShallowObject,
    ShallowObjectOrText,
    bounded,
    within,
)
from ferrum.entrypoints.openai.schema_types import (
    MAX_CHOICES,
    NOT_NULL,
    TOKEN_ID_TEXT_PATTERN,
    UNION_TAG,
    ListText,
    LogitBias,
    NonBlankText,
    NonEmptyText,
    NonNegativeInt,
    NumChoices,
    NumLogprobs,
    PositiveInt,
    TextList,
    TokenId,
    TokenIds,
    TokenIdText,
    excludes,
    implies,
    integer,
)
from ferrum.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LIST_CHARS,
    MAX_LIST_ITEMS,
    SamplingParams,
    StructuredOutputsParams,
)

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


# -- constrained output --


class JsonSchemaFormat(RequestModel):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    json_schema: ShallowObject = Field(alias="schema")
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

    json_: ShallowObjectOrText | None = Field(None, alias="json")
    regex: NonEmptyText | None = None
    choice: Annotated[TextList, Field(min_length=1)] | None = None
    grammar: NonEmptyText | None = None
    json_object: Literal[True] | None = None
    structural_tag: ShallowObjectOrText | None = None

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
    # vLLM's: with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: bool | None = False


NO_STREAMED_PROMPT_LOGPROBS = excludes({"stream": True, "prompt_logprobs": NOT_NULL})
STREAM_OPTIONS_NEED_STREAM = implies({"stream_options": NOT_NULL}, {"stream": True})
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
    stop: Annotated[ListText | TextList, within(MAX_LIST_ITEMS, MAX_LIST_CHARS)] | None = None
    stop_token_ids: Annotated[list[TokenId], *bounded(MAX_LIST_ITEMS)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: NonNegativeInt = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI: token id (as text) -> bias added to its logit, in [-100, 100].
    logit_bias: Annotated[dict[TokenIdText, LogitBias], *bounded(MAX_LIST_ITEMS)] | None = Field(
        None,
        json_schema_extra={
            "propertyNames": {"pattern": TOKEN_ID_TEXT_PATTERN, **TOKEN_ID_TEXT_SCHEMA}
        },
    )
    allowed_token_ids: (
        Annotated[list[TokenId], Field(min_length=1), *bounded(MAX_ALLOWED_TOKEN_IDS)] | None
    ) = None
    bad_words: Annotated[list[NonBlankText], *bounded(MAX_LIST_ITEMS, MAX_LIST_CHARS)] | None = None
    # vLLM's extension: per prompt token, its logprob and the top-k (not with stream=true).
    prompt_logprobs: NumLogprobs | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # No effect (see NO_EFFECT_FIELDS).
    user: str | None = None
    store: bool | None = None
    metadata: (
        Annotated[
            dict[
                Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)],
                Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)],
            ],
            *bounded(MAX_METADATA_PAIRS),
        ]
        | None
    ) = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

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

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options are only allowed with stream=true")
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

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries the usage so far."""
        options = self.stream_options
        return bool(options and options.include_usage and options.continuous_usage_stats)


def _prompt_form(value: Any) -> str:
    """The prompt's form by its first item, so that only that form reports errors."""
    first = value[0] if isinstance(value, list) and value else None
    if isinstance(value, str) or not isinstance(value, list):
        return f"{UNION_TAG}text"
    if isinstance(first, list):
        return f"{UNION_TAG}token_id_lists"
    return f"{UNION_TAG}token_ids" if isinstance(first, int | float) else f"{UNION_TAG}texts"


# Text, token ids, or a batch of either; a batch holds at most MAX_CHOICES prompts (n times the
# prompts is bounded by it).
Prompt = Annotated[
    Annotated[NonEmptyText, Tag(f"{UNION_TAG}text")]
    | Annotated[
        list[NonEmptyText], Field(min_length=1), *bounded(MAX_CHOICES), Tag(f"{UNION_TAG}texts")
    ]
    | Annotated[TokenIds, Tag(f"{UNION_TAG}token_ids")]
    | Annotated[
        list[TokenIds],
        Field(min_length=1),
        *bounded(MAX_CHOICES),
        Tag(f"{UNION_TAG}token_id_lists"),
    ],
    Discriminator(_prompt_form),
]


class CompletionRequest(SamplingRequest):
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                NO_STREAMED_PROMPT_LOGPROBS,
                STREAM_OPTIONS_NEED_STREAM,
                ONE_OUTPUT_CONSTRAINT,
            ]
        }
    )

    prompt: Prompt
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
    return_token_strs: bool | None = False


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: Annotated[list[TokenId], Field(fail_fast=True)]
