"""StopStrings: the same matches as scanning every stop string (earliest start, ties the first
listed), and a cost per new character that does not grow with the number of stop strings."""

from __future__ import annotations

import random

from ferrum.engine.detokenizer import IncrementalDetokenizer, StopStrings
from ferrum.sampling_params import MAX_LIST_ITEMS, SamplingParams


def _scan(stops: list[str], text: str, check_from: int) -> tuple[str, int] | None:
    """The reference: every stop string searched from where it could end after check_from."""
    best: tuple[str, int] | None = None
    for stop in stops:
        index = text.find(stop, max(0, check_from - len(stop) + 1))
        if index != -1 and (best is None or index < best[1]):
            best = (stop, index)
    return best


def test_matches_equal_a_scan_of_every_stop_string() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        alphabet = "ab" if rng.random() < 0.5 else "abcd "
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
            for _ in range(rng.randint(1, 6))
        ]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        check_from = rng.randint(0, len(text))
        assert StopStrings(stops).find(text, check_from) == _scan(stops, text, check_from), (
            stops,
            text,
            check_from,
        )


def test_ties_go_to_the_first_listed_and_duplicates_keep_their_first_place() -> None:
    assert StopStrings(["ab", "a"]).find("xab", 0) == ("ab", 1)
    assert StopStrings(["a", "ab"]).find("xab", 0) == ("a", 1)
    # A longer stop ending later but starting earlier wins.
    assert StopStrings(["bc", "abcd"]).find("abcd", 0) == ("abcd", 0)
    assert StopStrings(["b", "a", "b"]).find("ba", 0) == ("b", 0)
    assert StopStrings([]).find("anything", 0) is None


class _CountingDict(dict):
    """A dict that counts its `get` calls: the index's candidate look-ups."""

    calls = 0

    def get(self, key, default=None):  # noqa: ANN001, ANN201 - dict's own signature
        type(self).calls += 1
        return super().get(key, default)


def _lookups_per_char(stops: list[str], text: str) -> float:
    index = StopStrings(stops)
    index._first_index = _CountingDict(index._first_index)
    _CountingDict.calls = 0
    for end in range(1, len(text) + 1):
        assert index.find(text[:end], end - 1) is None
    return _CountingDict.calls / len(text)


def test_work_per_character_does_not_grow_with_the_number_of_stop_strings() -> None:
    # Each character looks up at most one candidate per distinct length of the stops ending in
    # it, whatever their number: a scan of every stop string would look at all 1024.
    text = "the quick brown fox jumps over the lazy dog 0123456789 " * 5
    many = [f"STOP{i}" for i in range(MAX_LIST_ITEMS)]
    assert _lookups_per_char(["STOP0", "STOP1"], text) <= 1
    assert _lookups_per_char(many, text) <= 4  # lengths 5..8 end in a digit


def test_detokenizer_stops_with_many_stop_strings(tmp_path) -> None:
    from ferrum.engine.tokenizer import Tokenizer
    from tests.utils.tokenizer_files import build_tokenizer_dir

    tok = Tokenizer.from_pretrained(build_tokenizer_dir(tmp_path))
    stops = [f"never{i}" for i in range(MAX_LIST_ITEMS - 1)] + ["lazy"]
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=stops))
    matched = None
    for token_id in tok.encode("the quick brown fox jumps over the lazy dog"):
        matched = detok.update([token_id], stop_terminated=False)
        if matched:
            break
    assert matched == "lazy"
    assert detok.output_text == "the quick brown fox jumps over the "
