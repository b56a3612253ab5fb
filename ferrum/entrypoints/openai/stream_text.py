"""Text helpers shared by the streaming output parsers (tool calls, reasoning): a parser sees the
output in arbitrary pieces, so a tag can arrive split (`<tool_c` then `all>`); it holds back any
tail that could still become a tag until the next piece decides, and these compute what to hold."""

from __future__ import annotations


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with (0 if none)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def split_trailing_space(text: str) -> tuple[str, str]:
    """`text` cut into (everything up to its trailing whitespace, the trailing whitespace)."""
    body = text.rstrip()
    return body, text[len(body) :]
