"""Prompt lookup: the tokens after the latest earlier occurrence of the longest matching suffix."""

from __future__ import annotations

from ferrum.model_executor.speculative.ngram_proposer import NgramProposer


def test_the_longest_suffix_match_wins_and_the_latest_occurrence_of_it() -> None:
    proposer = NgramProposer(3, min_n=1, max_n=3)
    # Suffix [1, 2, 3] occurs at 0 (followed by 9) and at 5 (followed by 4, 4, 4).
    tokens = [1, 2, 3, 9, 0, 1, 2, 3, 4, 4, 4, 7, 1, 2, 3]
    assert proposer.propose(tokens, 8) == [4, 4, 4]
    # Only the 1-gram [3] matches: its latest earlier occurrence is followed by 5, 6.
    assert proposer.propose([3, 5, 6, 0, 3], 8) == [5, 6, 0]


def test_limits_no_match_and_short_inputs() -> None:
    proposer = NgramProposer(4, min_n=2, max_n=4)
    assert proposer.propose([5, 6, 7, 5, 6], 1) == [7]
    assert proposer.propose([5, 6, 7, 5, 6], 0) == []
    assert proposer.propose([1, 2, 3, 4, 5], 4) == []  # no 2-gram repeats
    assert proposer.propose([5, 5, 9, 5], 4) == []  # a 1-gram is below min_n
    assert proposer.propose([7, 7], 4) == []
    assert proposer.propose([7, 7, 7], 4) == [7]  # [7, 7] at 0, followed by the last 7
