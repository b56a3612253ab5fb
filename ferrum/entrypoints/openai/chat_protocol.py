"""Pydantic models of POST /v1/chat/completions (and /tokenize with messages): messages by role,
tools and tool_choice, chat-template options, and the response shapes with tool calls and
reasoning. Validation rules are those of protocol.py (strict, unknown fields are errors)."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_serializer,
)

from ferrum.entrypoints.openai.protocol import (
    NO_STREAMED_PROMPT_LOGPROBS,
    ONE_OUTPUT_CONSTRAINT,
    STREAM_OPTIONS_NEED_STREAM,
    OpenAIModel,
    RequestModel,
    SamplingRequest,
    TokenizeCompletionRequest,
)
from ferrum.entrypoints.openai.request_limits import (
    MAX_MESSAGES,
    MAX_TOOLS,
    ShallowJSONText,
    ShallowObject,
    bounded,
    conversation_within_limits,
)
from ferrum.entrypoints.openai.responses import (
    PromptLogprobsJSON,
    UsageInfo,
)
from ferrum.entrypoints.openai.schema_types import (
    NOT_NULL,
    UNION_TAG,
    NumLogprobs,
    PositiveInt,
    implies,
)
from ferrum.entrypoints.openai.tool_protocol import (
    ChatCompletionTool,
    ToolChoice,
    check_named_tool,
)

# -- messages --------------------------------------------------------------------------------------


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


def _text_parts_only(value: Any) -> Any:
    """Image, audio and file parts get one clear error instead of a union's mismatch list."""
    if isinstance(value, list):
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(
                    f"content part type {kind!r} is not supported: ferrum takes text input only "
                    "(multimodal checkpoints serve their language model)"
                )
    return value


Content = Annotated[str | list[TextContentPart], BeforeValidator(_text_parts_only)]


def content_text(content: Content | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


class SystemMessage(RequestModel):
    role: Literal["system"]
    content: Content
    name: str | None = None


class DeveloperMessage(RequestModel):
    """OpenAI's newer name for a system message (rendered with role "developer")."""

    role: Literal["developer"]
    content: Content
    name: str | None = None


class UserMessage(RequestModel):
    role: Literal["user"]
    content: Content
    name: str | None = None


class FunctionCall(RequestModel):
    name: str
    arguments: ShallowJSONText  # JSON text, as OpenAI sends it


class AssistantToolCall(RequestModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(RequestModel):
    role: Literal["assistant"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    # A previous turn's reasoning; the chat template decides whether to render it.
    reasoning_content: str | None = None


class ToolMessage(RequestModel):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


# One class per role: a discriminator maps each role to one schema.
AnyMessage = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage
ChatMessage = Annotated[AnyMessage, Field(discriminator="role")]


def message_dict(message: AnyMessage) -> dict:
    """A message as chat templates read it: content as text ("" when absent), tool calls as
    OpenAI sends them (their JSON arguments are decoded before rendering)."""
    result = message.model_dump(exclude_none=True)
    result["content"] = content_text(message.content)
    return result


# The conversation is counted (messages, content parts, tool calls) before it is validated.
Messages = Annotated[
    list[ChatMessage],
    Field(min_length=1, max_length=MAX_MESSAGES),
    BeforeValidator(conversation_within_limits),
]
# A request's template: it runs on the server, so only one started with the flag takes it.
CHAT_TEMPLATE = Field(
    None,
    description="A chat template (Jinja text, or the name of one of the model's templates); a "
    "400 unless the server was started with --trust-request-chat-template",
)


def check_continue_final_message(value: bool, info: ValidationInfo) -> bool:
    if value and info.data.get("add_generation_prompt", True):
        raise ValueError(
            "continue_final_message needs add_generation_prompt=false: one continues the last "
            "message, the other starts a new assistant message"
        )
    return value


# -- request ---------------------------------------------------------------------------------------


class ChatCompletionRequest(SamplingRequest):
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                implies({"top_logprobs": NOT_NULL}, {"logprobs": True}),
                implies({"continue_final_message": True}, {"add_generation_prompt": False}),
                NO_STREAMED_PROMPT_LOGPROBS,
                STREAM_OPTIONS_NEED_STREAM,
                ONE_OUTPUT_CONSTRAINT,
            ]
        }
    )

    messages: Messages
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    tools: Annotated[list[ChatCompletionTool], *bounded(MAX_TOOLS)] | None = None
    # None: "auto" when tools are given, else "none" (OpenAI's default).
    tool_choice: ToolChoice | None = None
    # False: at most one tool call per response.
    parallel_tool_calls: bool | None = None
    chat_template: str | None = CHAT_TEMPLATE
    chat_template_kwargs: ShallowObject | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    # Cross-field rules are field validators (the error names the field); fields are
    # validated in declaration order, so `info.data` holds the ones above.
    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _named_tool_in_tools(
        cls, value: ToolChoice | None, info: ValidationInfo
    ) -> ToolChoice | None:
        return check_named_tool(value, info)

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_generate(cls, value: bool, info: ValidationInfo) -> bool:
        return check_continue_final_message(value, info)

    @property
    def effective_tool_choice(self) -> str | dict[str, Any]:
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        if isinstance(self.tool_choice, str):
            return self.tool_choice
        return self.tool_choice.model_dump()

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]


class TokenizeChatRequest(RequestModel):
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [implies({"continue_final_message": True}, {"add_generation_prompt": False})]
        }
    )

    model: str | None = None
    messages: Messages
    tools: Annotated[list[ChatCompletionTool], *bounded(MAX_TOOLS)] | None = None
    chat_template: str | None = CHAT_TEMPLATE
    chat_template_kwargs: ShallowObject | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_generate(cls, value: bool, info: ValidationInfo) -> bool:
        return check_continue_final_message(value, info)

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]


# -- responses -------------------------------------------------------------------------------------


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIModel):
    content: list[ChatTokenLogprob] | None = None


class ToolCallFunction(OpenAIModel):
    name: str
    arguments: str


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatResponseMessage(OpenAIModel):
    # "assistant", or the server's --response-role.
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    # vLLM's extension, with the request's prompt_logprobs.
    prompt_logprobs: PromptLogprobsJSON | None = None


class _SparseModel(OpenAIModel):
    """Stream deltas leave out the keys they do not set (OpenAI's chunks are sparse)."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(_SparseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_SparseModel):
    """The first entry of a call carries id, type and the name; the later ones argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(_SparseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


def _tokenize_form(body: Any) -> str:
    return (
        f"{UNION_TAG}messages"
        if isinstance(body, dict) and "messages" in body
        else f"{UNION_TAG}prompt"
    )


# POST /tokenize: text (`prompt`) or a conversation (`messages`), told apart by their key.
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag(f"{UNION_TAG}prompt")]
    | Annotated[TokenizeChatRequest, Tag(f"{UNION_TAG}messages")],
    Discriminator(_tokenize_form),
]
