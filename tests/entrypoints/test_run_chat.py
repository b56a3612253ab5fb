"""`ferrum run`: one-shot and interactive chat with streaming and multi-turn history."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest

from ferrum import SamplingParams
from ferrum.default_model import DEFAULT_MODEL_DIR
from ferrum.engine.llm_engine import LLMEngine
from ferrum.entrypoints.cli import build_parser, main
from ferrum.entrypoints.run_chat import ChatSession, default_params, run_chat

ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64"]
GREEDY = ["--temperature", "0", "--max-tokens", "6"]


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    args = build_parser().parse_args(["run", *ENGINE_FLAGS])
    from ferrum.engine.arg_utils import EngineArgs

    yield LLMEngine.from_engine_args(EngineArgs.from_cli_args(args, DEFAULT_MODEL_DIR))


def reference_reply(engine: LLMEngine, messages: list[dict[str, str]]) -> str:
    """What a plain, non-streamed greedy generation gives for the conversation."""
    tokenizer = engine.tokenizer
    assert tokenizer is not None
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    engine.add_request(
        "ref",
        {"prompt": text, "prompt_token_ids": ids},
        SamplingParams(temperature=0, max_tokens=6),
    )
    while True:
        for output in engine.step():
            if output.finished:
                return output.outputs[0].text


def test_multi_turn_history_and_streaming(engine: LLMEngine) -> None:
    session = ChatSession(engine, SamplingParams(temperature=0, max_tokens=6), system="Be kind.")
    pieces: list[str] = []
    first = session.reply("Hello!", pieces.append)
    assert first and "".join(pieces) == first and len(pieces) > 1
    conversation = [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hello!"},
    ]
    assert first == reference_reply(engine, conversation)
    second = session.reply("Tell me more.", lambda _: None)
    conversation += [
        {"role": "assistant", "content": first},
        {"role": "user", "content": "Tell me more."},
    ]
    assert second == reference_reply(engine, conversation)
    assert session.messages == [*conversation, {"role": "assistant", "content": second}]
    assert not engine.has_unfinished_requests()


def test_interrupted_reply_is_aborted_and_kept(engine: LLMEngine) -> None:
    session = ChatSession(engine, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    seen: list[str] = []

    def stop_after_two(piece: str) -> None:
        seen.append(piece)
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        session.reply("Hi", stop_after_two)
    assert not engine.has_unfinished_requests()
    assert engine.stats().kv_cache_usage == 0
    assert session.messages[-1] == {"role": "assistant", "content": "".join(seen)}


def test_one_shot_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", DEFAULT_MODEL_DIR, "Hello!", *ENGINE_FLAGS, *GREEDY])
    out = capsys.readouterr().out
    assert code == 0 and out.endswith("\n") and len(out.strip()) > 0


def test_interactive_until_exit() -> None:
    lines = iter(["Hi", "", "And then?", "/exit", "never read"])
    out = io.StringIO()
    args = build_parser().parse_args(["run", *ENGINE_FLAGS, *GREEDY])
    assert run_chat(args, read_line=lambda _: next(lines), out=out) == 0
    assert next(lines) == "never read"
    transcript = out.getvalue().splitlines()
    assert transcript[0].startswith("ferrum chat")
    assert len(transcript) >= 3


def test_ctrl_d_exits_cleanly() -> None:
    def eof(_: str) -> str:
        raise EOFError

    out = io.StringIO()
    args = build_parser().parse_args(["run", *ENGINE_FLAGS, *GREEDY])
    assert run_chat(args, read_line=eof, out=out) == 0


def test_single_positional_prompt_uses_the_shipped_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["run", "What is a package?", *ENGINE_FLAGS, *GREEDY])
    assert code == 0 and len(capsys.readouterr().out.strip()) > 0
    # A path that does not exist stays a model argument and fails clearly.
    assert main(["run", "/no/such/model", *ENGINE_FLAGS, *GREEDY]) == 2
    assert "is not a local model folder" in capsys.readouterr().err


def test_default_max_tokens_is_the_models_generation_limit(engine: LLMEngine) -> None:
    args = build_parser().parse_args(["run", *ENGINE_FLAGS])
    # The shipped model's generation_config.json: max_new_tokens 128.
    assert default_params(engine, args).max_tokens == 128
    args = build_parser().parse_args(["run", *ENGINE_FLAGS, "--max-tokens", "7"])
    assert default_params(engine, args).max_tokens == 7


def test_slash_commands_are_not_sent_to_the_model() -> None:
    lines = iter(["/help", "Hi", "/settings", "/clear", "/settings", "/nope", "/exit"])
    out = io.StringIO()
    args = build_parser().parse_args(["run", *ENGINE_FLAGS, *GREEDY, "--system", "Be brief."])
    assert run_chat(args, read_line=lambda _: next(lines), out=out) == 0
    text = out.getvalue()
    assert "/clear" in text and "forget the conversation" in text  # /help
    assert "turns so far: 1" in text and "turns so far: 0" in text  # /settings around /clear
    assert "max_tokens: 6" in text and "system: 'Be brief.'" in text
    assert "conversation cleared" in text
    assert "unknown command /nope" in text


def test_clear_keeps_the_system_message(engine: LLMEngine) -> None:
    session = ChatSession(engine, SamplingParams(temperature=0, max_tokens=2), system="Sys.")
    session.reply("Hi", lambda _: None)
    assert len(session.messages) == 3
    session.clear()
    assert session.messages == [{"role": "system", "content": "Sys."}]
