"""The API server's own options (vLLM's flag names): chat template, tools, reasoning, CORS."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from ferrum.entrypoints.openai.reasoning import REASONING_PARSERS, get_reasoning_parser
from ferrum.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser

# A --chat-template value with any of these is a template, not a file name.
_TEMPLATE_MARKERS = ("{{", "{%", "\n")


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    """How the server renders chats and parses their output, and which browsers may call it."""

    # Template text that replaces the model's own (None: the model's).
    chat_template: str | None = None
    # Whether a request may send its own template (it runs on the server: off by default).
    trust_request_chat_template: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    # The role of the messages chat completions return (vLLM's --response-role).
    response_role: str = "assistant"
    # Logprob tokens as "token_id:N" instead of their text (vLLM's flag of this name).
    return_tokens_as_token_ids: bool = False

    def __post_init__(self) -> None:
        if not self.response_role:
            raise ValueError("response_role must be a non-empty role name")
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (--tool-call-parser)")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{name} must be a list of strings, got {value!r}")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> FrontendConfig:
        return cls(
            chat_template=load_chat_template(args.chat_template),
            trust_request_chat_template=args.trust_request_chat_template,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            allowed_origins=args.allowed_origins,
            allowed_methods=args.allowed_methods,
            allowed_headers=args.allowed_headers,
            allow_credentials=args.allow_credentials,
            response_role=args.response_role,
            return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("chat, tools and CORS")
        group.add_argument(
            "--chat-template",
            default=None,
            help="chat template for every request: a file, or the template text itself "
            "(default: the model's)",
        )
        group.add_argument(
            "--trust-request-chat-template",
            action="store_true",
            help="let requests send their own chat_template (rendered in a sandbox, but on the "
            "server's CPU)",
        )
        group.add_argument(
            "--enable-auto-tool-choice",
            action="store_true",
            help='let the model decide to call tools (tool_choice "auto"); '
            "needs --tool-call-parser",
        )
        group.add_argument(
            "--tool-call-parser",
            choices=sorted(TOOL_PARSERS),
            default=None,
            help="how the model writes tool calls: hermes (Qwen2.5/Qwen3 JSON in <tool_call>), "
            "qwen3_coder (XML <function=...>)",
        )
        group.add_argument(
            "--reasoning-parser",
            choices=sorted(REASONING_PARSERS),
            default=None,
            help="split the model's <think> reasoning into reasoning_content",
        )
        for name, what in (
            ("origins", "origins"),
            ("methods", "HTTP methods"),
            ("headers", "headers"),
        ):
            group.add_argument(
                f"--allowed-{name}",
                type=_json_string_list,
                default=["*"],
                help=f'CORS: {what} browsers may use, as a JSON list (default ["*"])',
            )
        group.add_argument(
            "--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)"
        )
        group.add_argument(
            "--response-role",
            default="assistant",
            help="role of the messages chat completions return (default: assistant)",
        )
        group.add_argument(
            "--return-tokens-as-token-ids",
            action="store_true",
            help='logprob tokens as "token_id:N" (tokens that are not valid text stay exact)',
        )


def load_chat_template(value: str | None) -> str | None:
    """A --chat-template value as template text: a file's contents, or the value itself when it
    is a template; a name that is neither is an error."""
    if value is None:
        return None
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # a long template is not a valid path
        is_file = False
    if is_file:
        return path.read_text(encoding="utf-8")
    if any(marker in value for marker in _TEMPLATE_MARKERS):
        return value
    raise ValueError(
        f"chat_template {value!r} is neither a file nor a template (no '{{{{' or '{{%')"
    )


def _json_string_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f'expected a JSON list such as ["*"]: {e}') from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(
            f'expected a JSON list of strings such as ["*"], got {text}'
        )
    return value
