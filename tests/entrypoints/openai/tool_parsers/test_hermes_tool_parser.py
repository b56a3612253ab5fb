from __future__ import annotations

import json

import pytest

from ferrum.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    DeltaToolCall,
    HermesToolParser,
    Qwen3CoderToolParser,
    get_tool_parser,
)


def test_registry_names_and_error() -> None:
    assert get_tool_parser("hermes") is HermesToolParser
    assert get_tool_parser("qwen3_coder") is Qwen3CoderToolParser
    assert sorted(TOOL_PARSERS) == ["hermes", "qwen3_coder"]
    with pytest.raises(ValueError, match=r"'mistral'.*supported: hermes, qwen3_coder"):
        get_tool_parser("mistral")


def _calls(text: str) -> tuple[str, list[tuple[str, object]]]:
    content, calls = HermesToolParser().extract_tool_calls(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(
    "body",
    [
        "not json",
        "[1, 2]",
        '{"arguments": {}}',
        '{"name": 3, "arguments": {}}',
        '{"name": "f", "arguments": [1]}',
        '{"name": "f", "arguments": "not json"}',
        '{"name": "f"} trailing',
        "{" * 5000 + "}" * 5000,
    ],
)
def test_bodies_that_do_not_parse_stay_content(body: str) -> None:
    text = f"a <tool_call>{body}</tool_call> b"
    assert _calls(text) == (text, [])


def test_a_started_call_keeps_its_arguments_as_written() -> None:
    # The header committed the call: invalid or cut-off arguments are not turned into content.
    parser = HermesToolParser()
    content, calls = parser.extract_tool_calls(
        'a <tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call> b'
    )
    assert (content, [(c.name, c.arguments) for c in calls]) == ("a b", [("f", '{"x": NaN}')])
    content, calls = parser.extract_tool_calls('<tool_call>{"name": "f", "arguments": {"x": [1, ')
    assert (content, [(c.name, c.arguments) for c in calls]) == ("", [("f", '{"x": [1, ')])


def test_arguments_stream_as_they_arrive_name_first() -> None:
    arguments = json.dumps({"query": "a long question " * 4, "filters": {"n": [1, 2, 3]}})
    text = f'Sure.\n<tool_call>\n{{"name": "search", "arguments": {arguments}}}\n</tool_call>'
    parser = HermesToolParser()
    deltas = []
    for char in text:
        deltas += parser.extract_tool_calls_streaming(char).tool_calls
    deltas += parser.finish().tool_calls
    assert deltas[0].name == "search" and deltas[0].arguments == ""
    fragments = [d.arguments for d in deltas[1:]]
    assert all(d.name is None and d.index == 0 for d in deltas[1:])
    assert len(fragments) == len(arguments)  # one per character: nothing waits for the end
    assert "".join(fragments) == arguments
    assert HermesToolParser().extract_tool_calls(text)[1][0].arguments == arguments


def test_accepted_call_shapes() -> None:
    text = (
        '<tool_call>  {"name": "a", "arguments": {"x": 1}, "extra": true}  </tool_call>'
        '<tool_call>{"name": "b"}</tool_call>'
        '<tool_call>{"name": "c", "arguments": "{\\"y\\": [true]}"}</tool_call>'
    )
    assert _calls(text) == ("", [("a", {"x": 1}), ("b", {}), ("c", {"y": [True]})])


def test_separating_whitespace_is_dropped_but_text_after_a_call_keeps_its_own() -> None:
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert _calls(f"Sure.\n\n{call}\n{call}\n\n")[0] == "Sure."
    assert _calls(f"{call}\n Then text. ")[0] == "\n Then text. "
    assert _calls(f"{call}\n<tool_")[0] == "\n<tool_"
    assert _calls("  only blanks \n")[0] == "  only blanks \n"


def test_streaming_deltas_name_first_then_arguments() -> None:
    parser = HermesToolParser()
    first = parser.extract_tool_calls_streaming('Hi <tool_call>{"name": "f", "argu')
    assert first.content == "Hi" and first.tool_calls == []
    second = parser.extract_tool_calls_streaming('ments": {"k": "v"}}</tool_call>')
    assert second.content == ""
    header, arguments = second.tool_calls
    assert header.index == 0 and header.id is not None and header.id.startswith("call_")
    assert (header.name, header.arguments) == ("f", "")
    assert arguments == DeltaToolCall(0, None, None, '{"k": "v"}')
    assert parser.finish().content == ""
    with pytest.raises(RuntimeError):
        parser.extract_tool_calls_streaming("x")


def test_partial_start_tag_is_held_until_decided() -> None:
    parser = HermesToolParser()
    assert parser.extract_tool_calls_streaming("text <tool_c").content == "text"
    assert parser.extract_tool_calls_streaming("ar").content == " <tool_car"
    assert parser.extract_tool_calls_streaming(" <").content == ""
    assert parser.finish().content == " <"


def test_extract_does_not_touch_the_streaming_state() -> None:
    parser = HermesToolParser()
    assert parser.extract_tool_calls_streaming("a <tool_call>").content == "a"
    assert parser.extract_tool_calls('<tool_call>{"name": "g"}</tool_call>')[1][0].name == "g"
    delta = parser.extract_tool_calls_streaming('{"name": "f"}</tool_call>')
    assert delta.tool_calls[0].name == "f"


def test_call_format_is_the_syntax_the_parser_reads() -> None:
    fmt = HermesToolParser.call_format("get_weather", {"type": "object"})
    text = fmt["begin"] + '{"city": "Paris"}' + fmt["end"]
    assert _calls(text) == ("", [("get_weather", {"city": "Paris"})])
