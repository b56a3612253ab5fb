"""`ferrum run [MODEL] [PROMPT]`: chat with a model in the terminal. With PROMPT it answers once
(`ferrum run "PROMPT"` alone uses the shipped model when PROMPT is not a path); without, it reads
turns until `/exit`, Ctrl-D or Ctrl-C. Lines starting with `/` are commands (`/help`), never sent.
Each turn renders the whole conversation through the chat template; Ctrl-C stops only the reply.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from ferrum.default_model import DEFAULT_MODEL_DIR
from ferrum.engine.arg_utils import EngineArgs
from ferrum.entrypoints.sampling_args import add_sampling_args, sampling_overrides
from ferrum.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from ferrum.engine.llm_engine import LLMEngine

EXIT_COMMANDS = ("/exit", "/quit")
# Without --max-tokens, a reply is at most the model's generation_config.json max_new_tokens, else
# this many tokens (and never more than the context has room for).
RUN_MAX_TOKENS = 512
HELP_TEXT = """commands:
  /help           this list
  /clear          forget the conversation (the system message stays)
  /settings       show the model and the sampling settings
  /exit, /quit    leave (also Ctrl-D); Ctrl-C stops a reply
"""


def add_run_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    parser.add_argument("prompt", nargs="?", default=None, help="answer this once and exit")
    parser.add_argument("--system", default=None, help="system message of the conversation")
    add_sampling_args(
        parser,
        f"the model's generation_config.json max_new_tokens, else {RUN_MAX_TOKENS}; never more "
        "than the context has room for",
        "the model's generation_config.json values, else SamplingParams' defaults",
        from_model=True,
    )


class ChatSession:
    """A conversation with one engine: the history, and one streamed reply per turn."""

    def __init__(
        self, engine: LLMEngine, params: SamplingParams, system: str | None = None
    ) -> None:
        if engine.tokenizer is None:
            raise ValueError("skip_tokenizer_init: chat needs a tokenizer")
        self.engine = engine
        self.params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.clear()
        self._ids = itertools.count()

    def clear(self) -> None:
        """Forgets the conversation; the system message stays."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def describe(self) -> str:
        """The model and the sampling settings, one per line."""
        p = self.params
        max_tokens = p.max_tokens if p.max_tokens is not None else "the context left"
        lines = [
            f"model: {self.engine.config.model_config.model}",
            f"max_tokens: {max_tokens}",
            f"temperature: {p.temperature}, top_p: {p.top_p}, top_k: {p.top_k}, min_p: {p.min_p}",
            f"repetition_penalty: {p.repetition_penalty}, seed: {p.seed}",
            f"system: {self.system!r}",
            f"turns so far: {sum(m['role'] == 'user' for m in self.messages)}",
        ]
        return "\n".join(lines) + "\n"

    def reply(self, user_text: str, on_text: Callable[[str], None]) -> str:
        """Generates the assistant's answer, calling `on_text` with each new piece of text; the
        turn is added to the history (also when interrupted, with the text so far)."""
        tokenizer = self.engine.tokenizer
        assert tokenizer is not None
        messages = [*self.messages, {"role": "user", "content": user_text}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        params = self.params
        room = self.engine.input_processor.max_tokens_room(len(token_ids))
        if room < 1:
            raise ValueError(
                f"the conversation ({len(token_ids)} tokens) fills the context; /clear to start "
                "over"
            )
        if params.max_tokens is None or params.max_tokens > room:
            params = dataclasses.replace(
                params, max_tokens=room, min_tokens=min(params.min_tokens, room)
            )
        request_id = f"chat-{next(self._ids)}"
        self.engine.add_request(request_id, {"prompt": text, "prompt_token_ids": token_ids}, params)
        sent = ""
        try:
            finished = False
            while not finished:
                for output in self.engine.step():
                    if output.request_id != request_id:
                        continue
                    delta = output.outputs[0].text
                    if delta:
                        sent += delta
                        on_text(delta)
                    finished = output.finished
        finally:
            self.engine.abort_request(request_id)
            self.messages = [*messages, {"role": "assistant", "content": sent}]
        return sent


def default_params(engine: LLMEngine, args: argparse.Namespace) -> SamplingParams:
    """The model's generation_config.json values (max_tokens: its max_new_tokens, else
    RUN_MAX_TOKENS), overridden by the flags given."""
    values: dict[str, Any] = {"max_tokens": RUN_MAX_TOKENS}
    values.update(engine.config.model_config.default_sampling_kwargs())
    values.update(sampling_overrides(args))
    return SamplingParams(**values)


def _run_command(session: ChatSession, command: str) -> str:
    """Runs a `/command`; returns what to print."""
    name = command.split()[0]
    if name == "/help":
        return HELP_TEXT
    if name == "/clear":
        session.clear()
        return "conversation cleared\n"
    if name == "/settings":
        return session.describe()
    return f"unknown command {name}; /help lists the commands\n"


def _is_prompt_not_model(value: str) -> bool:
    return not os.path.isdir(value) and os.sep not in value


def run_chat(
    args: argparse.Namespace,
    read_line: Callable[[str], str] = input,
    out: TextIO | None = None,
) -> int:
    from ferrum.engine.llm_engine import LLMEngine

    out = out or sys.stdout
    if args.prompt is None and args.model is not None and _is_prompt_not_model(args.model):
        # `ferrum run "PROMPT"`: one positional that is no model folder is the prompt.
        args.prompt, args.model = args.model, None
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args, DEFAULT_MODEL_DIR))
    session = ChatSession(engine, default_params(engine, args), args.system)

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    if args.prompt is not None:
        session.reply(args.prompt, write)
        write("\n")
        return 0
    write("ferrum chat: type a message; /help for commands, /exit or Ctrl-D to quit.\n")
    while True:
        try:
            line = read_line(">>> ")
        except (EOFError, KeyboardInterrupt):
            write("\n")
            return 0
        command = line.strip()
        if command in EXIT_COMMANDS:
            return 0
        if not command:
            continue
        if command.startswith("/"):
            write(_run_command(session, command))
            continue
        try:
            session.reply(line, write)
        except KeyboardInterrupt:
            write(" [interrupted]")
        except ValueError as e:
            write(f"error: {e}")
        write("\n")
