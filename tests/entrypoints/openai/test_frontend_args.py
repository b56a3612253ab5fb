"""Server flags: chat template from a file or inline, tool and reasoning parsers, CORS lists."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from ferrum.entrypoints.openai.frontend_args import FrontendConfig, load_chat_template


def parse(*argv: str) -> FrontendConfig:
    parser = argparse.ArgumentParser()
    FrontendConfig.add_cli_args(parser)
    return FrontendConfig.from_cli_args(parser.parse_args(list(argv)))


def test_defaults_follow_vllm() -> None:
    config = parse()
    assert config.chat_template is None and not config.trust_request_chat_template
    assert config.tool_call_parser is None and config.reasoning_parser is None
    assert config.allowed_origins == ["*"] and not config.allow_credentials


def test_chat_template_from_a_file_or_inline(tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert load_chat_template(str(path)) == template
    assert load_chat_template(template) == template
    with pytest.raises(ValueError, match="neither a file nor a template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_parsers_and_cors_flags() -> None:
    config = parse(
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "qwen3_coder",
        "--reasoning-parser",
        "qwen3",
        "--allowed-origins",
        '["http://localhost:3000"]',
        "--allow-credentials",
    )
    assert config.tool_call_parser == "qwen3_coder" and config.reasoning_parser == "qwen3"
    assert config.allowed_origins == ["http://localhost:3000"] and config.allow_credentials


def test_auto_tool_choice_needs_a_parser() -> None:
    with pytest.raises(ValueError, match="tool_call_parser"):
        parse("--enable-auto-tool-choice")


@pytest.mark.parametrize(
    "argv",
    [
        ["--tool-call-parser", "mistral"],
        ["--reasoning-parser", "deepseek"],
        ["--allowed-origins", "http://x"],
        ["--allowed-origins", '{"a": 1}'],
    ],
)
def test_bad_flags_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse(*argv)
