from __future__ import annotations

from ferrum.entrypoints.openai.stream_text import partial_tag_len, split_trailing_space


def test_partial_tag_len_is_the_longest_proper_prefix_at_the_end() -> None:
    assert partial_tag_len("abc<tool_c", "<tool_call>") == 7
    assert partial_tag_len("abc<", "<tool_call>") == 1
    assert partial_tag_len("abc", "<tool_call>") == 0
    assert partial_tag_len("", "<tool_call>") == 0
    # A whole tag is not a partial one: the caller finds it with str.find.
    assert partial_tag_len("x<tool_call>", "<tool_call>") == 0
    assert partial_tag_len("<<", "<<x") == 2
    assert partial_tag_len("a<<", "<<x") == 2


def test_split_trailing_space() -> None:
    assert split_trailing_space("ab \n\t") == ("ab", " \n\t")
    assert split_trailing_space(" \n") == ("", " \n")
    assert split_trailing_space("a b") == ("a b", "")
