from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from ferrum.engine.chat_template import ChatTemplateRenderer
from ferrum.engine.tokenizer import Tokenizer
from tests.utils.tokenizer_files import (
    BEGIN_OF_TEXT,
    CHATML_TEMPLATE,
    GEMMA3_TEMPLATE,
    LLAMA3_TEMPLATE,
    QWEN3_TEMPLATE,
    build_tokenizer_dir,
)

transformers = pytest.importorskip("transformers")

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? <b>bold</b> & ünïcode 日本"},
    ],
    [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
        {"role": "assistant", "content": "four"},
    ],
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city, e.g. <Paris>",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "Città"}},
            "required": ["city"],
        },
    },
}

QWEN3_CONVERSATIONS: list[list[dict[str, Any]]] = [
    *CONVERSATIONS,
    [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I should call the tool.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": '{"temp_c": 21}'},
        {"role": "tool", "content": '{"sky": "clear"}'},
        {"role": "assistant", "content": "<think>\nIt is warm.\n</think>\n\nIt is 21°C and clear."},
        {"role": "user", "content": "Thanks"},
    ],
    [
        {"role": "user", "content": "Solve it"},
        {"role": "assistant", "content": "Done", "reasoning": "thinking under another name"},
    ],
]


def _both(path: Path) -> tuple[Tokenizer, Any]:
    return Tokenizer.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any]:
    return _both(build_tokenizer_dir(tmp_path_factory.mktemp("chatml")))


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any]:
    path = build_tokenizer_dir(
        tmp_path_factory.mktemp("llama3"),
        chat_template=LLAMA3_TEMPLATE,
        bos_token=BEGIN_OF_TEXT,
        add_bos=True,
    )
    return _both(path)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any]:
    return _both(
        build_tokenizer_dir(tmp_path_factory.mktemp("qwen3"), chat_template=QWEN3_TEMPLATE)
    )


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any]:
    path = build_tokenizer_dir(
        tmp_path_factory.mktemp("gemma3"), chat_template=GEMMA3_TEMPLATE, bos_token="<bos>"
    )
    return _both(path)


GEMMA3_CONVERSATIONS = [
    *CONVERSATIONS,
    [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": " two "}, {"type": "text", "text": "parts"}],
        },
    ],
]


@pytest.mark.parametrize("conversation", GEMMA3_CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gemma3_template_matches_transformers(
    gemma3: tuple[Tokenizer, Any], conversation: list[dict], add_generation_prompt: bool
) -> None:
    ours, theirs = gemma3
    expected = theirs.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    got = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert got == expected and got.startswith("<bos><start_of_turn>user\n")


def test_gemma3_template_errors_and_image_parts(gemma3: tuple[Tokenizer, Any]) -> None:
    ours, _ = gemma3
    with pytest.raises(ValueError, match="roles must alternate"):
        ours.apply_chat_template([{"role": "assistant", "content": "x"}])
    image = {"type": "image", "url": "cat.png"}
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\]: content type 'image'"):
        ours.apply_chat_template(
            [{"role": "user", "content": [{"type": "text", "text": "a"}, image]}]
        )


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chatml_matches_transformers(
    chatml: tuple[Tokenizer, Any], conversation: list[dict], add_generation_prompt: bool
) -> None:
    ours, theirs = chatml
    expected = theirs.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == (
        expected
    )


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]])
def test_llama3_template_with_bos_matches_transformers(
    llama3: tuple[Tokenizer, Any],
    conversation: list[dict],
    add_generation_prompt: bool,
    tools: list[dict] | None,
) -> None:
    ours, theirs = llama3
    kwargs = {"date_string": "26 Jul 2024"}
    expected = theirs.apply_chat_template(
        conversation,
        tools=tools,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )
    got = ours.apply_chat_template(
        conversation, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
    )
    assert got == expected
    assert got.startswith(BEGIN_OF_TEXT)
    # The rendered prompt already holds BOS, so it is encoded without adding special tokens.
    ids = ours.encode(got, add_special_tokens=False)
    assert ids.count(ours.bos_token_id) == 1


@pytest.mark.parametrize("conversation", QWEN3_CONVERSATIONS)
@pytest.mark.parametrize("enable_thinking", [None, True, False])
@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]])
def test_qwen3_template_matches_transformers(
    qwen3: tuple[Tokenizer, Any],
    conversation: list[dict],
    enable_thinking: bool | None,
    tools: list[dict] | None,
) -> None:
    ours, theirs = qwen3
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    expected = theirs.apply_chat_template(
        conversation, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert ours.apply_chat_template(conversation, tools=tools, **kwargs) == expected


def test_qwen3_enable_thinking_false_closes_empty_think_block(qwen3: tuple[Tokenizer, Any]) -> None:
    ours, _ = qwen3
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert ours.apply_chat_template(messages).endswith("<|im_start|>assistant\n")


def test_continue_final_message_matches_transformers(chatml: tuple[Tokenizer, Any]) -> None:
    ours, theirs = chatml
    conversation = [
        {"role": "user", "content": "Count"},
        {"role": "assistant", "content": "1, 2,"},
    ]
    expected = theirs.apply_chat_template(conversation, tokenize=False, continue_final_message=True)
    got = ours.apply_chat_template(
        conversation, add_generation_prompt=False, continue_final_message=True
    )
    assert got == expected
    assert got.endswith("1, 2,")
    with pytest.raises(ValueError, match="continue_final_message"):
        ours.apply_chat_template(conversation, continue_final_message=True)


def test_model_without_template_raises(tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(build_tokenizer_dir(tmp_path / "tok", chat_template=None))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    # An explicit template still works.
    explicit = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=explicit) == (
        "[hi]"
    )


def test_named_templates_match_transformers(tmp_path: Path) -> None:
    templates = [
        {"name": "default", "template": CHATML_TEMPLATE},
        {"name": "tool_use", "template": "TOOLS{{ tools | length }}" + CHATML_TEMPLATE},
        {"name": "short", "template": "{{ messages[-1].content }}"},
    ]
    ours, theirs = _both(build_tokenizer_dir(tmp_path / "tok", chat_template=templates))
    messages = CONVERSATIONS[1]
    for tools, name in [(None, None), ([WEATHER_TOOL], None), (None, "short")]:
        expected = theirs.apply_chat_template(
            messages, tools=tools, chat_template=name, tokenize=False, add_generation_prompt=True
        )
        assert ours.apply_chat_template(messages, tools=tools, chat_template=name) == expected
    assert ours.apply_chat_template(messages, tools=[WEATHER_TOOL]).startswith("TOOLS1")


def test_template_without_default_name_raises(tmp_path: Path) -> None:
    templates = [{"name": "a", "template": "A"}, {"name": "b", "template": "B"}]
    tok = Tokenizer.from_pretrained(build_tokenizer_dir(tmp_path / "tok", chat_template=templates))
    with pytest.raises(ValueError, match=r"\['a', 'b'\]"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template="b") == "B"


def test_jinja_file_overrides_config_template(tmp_path: Path) -> None:
    path = build_tokenizer_dir(tmp_path / "tok")
    (path / "chat_template.jinja").write_text("FILE:{{ messages[0].content }}")
    ours, theirs = _both(path)
    messages = [{"role": "user", "content": "x"}]
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected == "FILE:x"


def test_none_valued_keys_are_dropped(chatml: tuple[Tokenizer, Any]) -> None:
    ours, _ = chatml
    template = "{% for m in messages %}{{ 'name' in m }},{{ m.get('name', 'none') }};{% endfor %}"
    messages = [{"role": "user", "content": "a", "name": None}]
    assert ours.apply_chat_template(messages, chat_template=template) == "False,none;"


def test_tojson_keeps_html_and_unicode() -> None:
    renderer = ChatTemplateRenderer()
    template = "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=true) }}"
    message = {"role": "user", "content": "<b>é</b> & 日本"}
    out = renderer.render(template, [message], add_generation_prompt=False)
    assert out == json.dumps(message, ensure_ascii=False) + "|" + json.dumps(
        message, ensure_ascii=False, indent=2, sort_keys=True
    )


def test_template_helpers() -> None:
    renderer = ChatTemplateRenderer()
    messages = [{"role": "user", "content": "hi"}]
    year = renderer.render('{{ strftime_now("%Y") }}', messages, add_generation_prompt=False)
    assert year == str(datetime.now().year)
    generation = (
        "{% for m in messages %}{% generation %}<{{ m.content }}>{% endgeneration %}{% endfor %}"
    )
    assert renderer.render(generation, messages, add_generation_prompt=False) == "<hi>"
    loops = "{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    assert renderer.render(loops, messages, add_generation_prompt=False) == "012"
    ns = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
        "{{ ns.n }}"
    )
    assert renderer.render(ns, messages, add_generation_prompt=False) == "1"
    # trim_blocks + lstrip_blocks: block tags leave no newline or indentation behind.
    blocks = "  {% if true %}\nA\n  {% endif %}\nB"
    assert renderer.render(blocks, messages, add_generation_prompt=False) == "A\nB"


def test_template_errors_become_value_errors() -> None:
    renderer = ChatTemplateRenderer()
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="roles must alternate"):
        renderer.render(
            "{{ raise_exception('roles must alternate') }}", messages, add_generation_prompt=False
        )
    with pytest.raises(ValueError, match="not valid Jinja"):
        renderer.render("{% for %}", messages, add_generation_prompt=False)
    with pytest.raises(ValueError, match="underscore"):
        renderer.render(
            "{% set ns = namespace() %}{% set ns._x = 1 %}", messages, add_generation_prompt=False
        )
    # The sandbox refuses attribute access to Python internals.
    with pytest.raises(ValueError):
        renderer.render(
            "{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}",
            messages,
            add_generation_prompt=False,
        )


def test_bad_messages_raise(chatml: tuple[Tokenizer, Any]) -> None:
    ours, _ = chatml
    with pytest.raises(ValueError, match="messages"):
        ours.apply_chat_template([])
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        ours.apply_chat_template(["hi"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}], tools=["x"])  # type: ignore[list-item]


def test_caller_messages_are_not_modified(chatml: tuple[Tokenizer, Any]) -> None:
    ours, _ = chatml
    messages = [{"role": "user", "content": "a", "reasoning": "r", "extra": None}]
    snapshot = json.dumps(messages)
    ours.apply_chat_template(messages, add_generation_prompt=False)
    ours.apply_chat_template(
        [{"role": "assistant", "content": "x"}],
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert json.dumps(messages) == snapshot
