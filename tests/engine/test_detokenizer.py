from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from ferrum.engine.detokenizer import IncrementalDetokenizer
from ferrum.engine.tokenizer import Tokenizer
from ferrum.sampling_params import SamplingParams
from tests.utils.tokenizer_files import ENDOFTEXT, IM_END, IM_START, build_tokenizer_dir

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_pretrained(build_tokenizer_dir(tmp_path_factory.mktemp("tok")))


def _stream(
    tok: Tokenizer, ids: list[int], params: SamplingParams, prompt: list[int] | None = None
) -> tuple[IncrementalDetokenizer, list[str]]:
    detok = IncrementalDetokenizer(tok, prompt if prompt is not None else [], params)
    deltas = []
    for token_id in ids:
        assert detok.update([token_id], stop_terminated=False) is None
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
    return detok, deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_id_streams_match_full_decode(tok: Tokenizer, skip_special_tokens: bool) -> None:
    rng = random.Random(0)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(60):
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 8))]
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(tok, prompt, params)
        for step, token_id in enumerate(ids, start=1):
            detok.update([token_id], stop_terminated=False)
            full = tok.decode(ids[:step], skip_special_tokens=skip_special_tokens)
            # Everything up to an unfinished trailing character is out; nothing partial is.
            assert detok.output_text == full.rstrip(REPLACEMENT)
        assert detok.get_next_output_text(finished=True, delta=False) == full
        assert detok.token_ids == ids


def test_multibyte_characters_are_never_split(tok: Tokenizer) -> None:
    text = "日本語のテキスト 😀 👍🏽 🇫🇷 café 한국어"
    ids = tok.encode(text)
    detok, deltas = _stream(tok, ids, SamplingParams())
    assert all(REPLACEMENT not in d for d in deltas)
    # Some tokens hold only part of a character, so some steps emit nothing.
    assert "" in deltas
    assert "".join(deltas) == text
    assert detok.get_next_output_text(finished=True, delta=True) == ""
    assert detok.get_next_output_text(finished=True, delta=False) == text


def test_unfinished_character_is_emitted_when_request_ends(tok: Tokenizer) -> None:
    emoji_bytes = tok.encode("😀")
    assert len(emoji_bytes) > 1
    cut = emoji_bytes[:-1]
    ids = tok.encode("ok ") + cut
    detok, deltas = _stream(tok, ids, SamplingParams())
    assert "".join(deltas) == "ok "
    final = detok.get_next_output_text(finished=True, delta=True)
    assert "ok " + final == tok.decode(ids)
    assert final and set(final) == {REPLACEMENT}


def test_skip_special_tokens(tok: Tokenizer) -> None:
    text = f"hi{IM_START}there{IM_END} end"
    ids = tok.encode(text)
    _, shown = _stream(tok, ids, SamplingParams(skip_special_tokens=False))
    assert "".join(shown) == text
    _, hidden = _stream(tok, ids, SamplingParams(skip_special_tokens=True))
    assert "".join(hidden) == "hithere end"


def test_prompt_context_does_not_leak_into_output(tok: Tokenizer) -> None:
    prompt = tok.encode(f"{IM_START}user\nSay hi{IM_END}\n{IM_START}assistant\n")
    ids = tok.encode(" Hello there")
    detok, deltas = _stream(tok, ids, SamplingParams(), prompt=prompt)
    assert "".join(deltas) == " Hello there" == tok.decode(ids)


def test_stop_string_across_token_boundaries(tok: Tokenizer) -> None:
    text = "The end is near; the end is here. More"
    stop = "end is h"
    ids = tok.encode(text)
    params = SamplingParams(stop=[stop])
    detok = IncrementalDetokenizer(tok, [], params)
    matched, num_fed = None, 0
    for token_id in ids:
        num_fed += 1
        matched = detok.update([token_id], stop_terminated=False)
        if matched is not None:
            break
    assert matched == stop
    # The stop string spans several tokens and was found as soon as its last piece arrived.
    assert tok.decode(ids[:num_fed]).find(stop) + len(stop) > len(tok.decode(ids[: num_fed - 1]))
    assert detok.output_text == "The end is near; the "
    assert detok.get_next_output_text(finished=True, delta=False) == "The end is near; the "


def test_stop_string_included_when_asked(tok: Tokenizer) -> None:
    ids = tok.encode("The end is near; the end is here. More")
    detok = IncrementalDetokenizer(
        tok, [], SamplingParams(stop=["end is h"], include_stop_str_in_output=True)
    )
    matched = None
    for token_id in ids:
        matched = detok.update([token_id], stop_terminated=False)
        if matched:
            break
    assert matched == "end is h"
    assert detok.get_next_output_text(finished=True, delta=False) == "The end is near; the end is h"


def test_earliest_stop_string_wins_within_one_update(tok: Tokenizer) -> None:
    ids = tok.encode("abc STOP here. The end")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["The", "here", "STOP"]))
    assert detok.update(ids, stop_terminated=False) == "STOP"
    assert detok.output_text == "abc "


def test_ids_after_the_stop_string_in_one_update_are_dropped(tok: Tokenizer) -> None:
    """Several ids in one update (accepted drafts): the output ends with the id that completed
    the stop string, as when the ids come one at a time."""
    ids = tok.encode("The end is near; the end is here. More")
    one_by_one = IncrementalDetokenizer(tok, [], SamplingParams(stop=["end is h"]))
    for token_id in ids:
        if one_by_one.update([token_id], stop_terminated=False):
            break
    together = IncrementalDetokenizer(tok, [], SamplingParams(stop=["end is h"]))
    assert together.update(ids, stop_terminated=False) == "end is h"
    assert together.token_ids == one_by_one.token_ids == ids[: len(one_by_one.token_ids)]
    assert len(together.token_ids) < len(ids)
    assert together.output_text == one_by_one.output_text == "The end is near; the "


def test_stop_string_holdback_in_deltas(tok: Tokenizer) -> None:
    text = "Numbers 0123456789 and STOP here"
    stop = "STOP here"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=[stop, "xy"]))
    streamed = ""
    for token_id in ids:
        matched = detok.update([token_id], stop_terminated=False)
        finished = matched is not None
        streamed += detok.get_next_output_text(finished=finished, delta=True)
        if finished:
            break
        # The last len(stop) - 1 characters stay back while unfinished.
        assert streamed == detok.output_text[: max(len(detok.output_text) - (len(stop) - 1), 0)]
        # A partial "STOP here" was never streamed, even while output_text ended with one.
        assert "S" not in streamed
    assert matched == stop
    assert streamed == "Numbers 0123456789 and "


def test_holdback_released_on_finish_without_match(tok: Tokenizer) -> None:
    ids = tok.encode("no match at all")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["zzzz"]))
    detok.update(ids, stop_terminated=False)
    assert detok.get_next_output_text(finished=False, delta=True) == "no match at "
    assert detok.get_next_output_text(finished=True, delta=True) == "all"


def test_stop_token_text_is_not_detokenized(tok: Tokenizer) -> None:
    eos = tok.backend.token_to_id(IM_END)
    ids = [*tok.encode("done"), eos]
    params = SamplingParams(skip_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], params)
    assert detok.update(ids, stop_terminated=True) is None
    assert detok.output_text == "done"
    assert detok.token_ids == ids
    # include_stop_str_in_output decodes the stop token too (hidden here by skip_special_tokens).
    shown = IncrementalDetokenizer(tok, [], SamplingParams(include_stop_str_in_output=True))
    shown.update(ids, stop_terminated=True)
    assert shown.output_text == "done"
    visible = IncrementalDetokenizer(
        tok, [], SamplingParams(include_stop_str_in_output=True, skip_special_tokens=False)
    )
    visible.update(ids, stop_terminated=True)
    assert visible.output_text == "done" + IM_END


def test_min_tokens_delays_stop_strings(tok: Tokenizer) -> None:
    ids = tok.encode("STOP and then STOP again")
    first_stop_tokens = len(tok.encode("STOP"))
    params = SamplingParams(stop=["STOP"], min_tokens=first_stop_tokens + 1)
    detok = IncrementalDetokenizer(tok, [], params)
    matched = None
    for token_id in ids:
        matched = detok.update([token_id], stop_terminated=False)
        if matched:
            break
    assert matched == "STOP"
    assert detok.output_text == "STOP and then "


def test_no_tokenizer_or_detokenize_false_keeps_text_empty(tok: Tokenizer) -> None:
    ids = tok.encode("STOP now")
    with pytest.raises(ValueError, match="SamplingParams.stop strings need detokenize=True"):
        SamplingParams(stop=["STOP"], detokenize=False)
    for detok in (
        IncrementalDetokenizer(None, [1, 2], SamplingParams(stop=["STOP"])),
        IncrementalDetokenizer(tok, [1, 2], SamplingParams(detokenize=False)),
    ):
        assert detok.update(ids, stop_terminated=False) is None
        assert detok.update([5], stop_terminated=True) is None
        assert detok.output_text == ""
        assert detok.get_next_output_text(finished=True, delta=True) == ""
        assert detok.token_ids == [*ids, 5]


def test_each_step_decodes_a_bounded_window(tok: Tokenizer) -> None:
    lengths: list[int] = []

    class CountingTokenizer:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            lengths.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    text = "The quick brown fox jumps over the lazy dog. " * 20 + "日本語 😀" * 5
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(
        CountingTokenizer(), tok.encode("prompt " * 50), SamplingParams()
    )  # type: ignore[arg-type]
    for token_id in ids:
        detok.update([token_id], stop_terminated=False)
    assert detok.get_next_output_text(finished=True, delta=False) == text
    assert len(ids) > 300 and max(lengths) <= 12


def test_metaspace_leading_space_uses_prompt_context() -> None:
    vocab = {"▁The": 0, "▁capital": 1, "▁is": 2, "▁Paris": 3, ".": 4, "<unk>": 5}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = Tokenizer(backend)
    prompt = tok.encode("The capital is")
    generated = [vocab["▁Paris"], vocab["."]]
    assert tok.decode(generated) == "Paris."
    detok, deltas = _stream(tok, generated, SamplingParams(), prompt=prompt)
    # As in a completion: prompt text + output text == decode(prompt + output).
    assert "".join(deltas) == " Paris."
    assert tok.decode(prompt) + detok.output_text == tok.decode(prompt + generated)


def test_special_token_runs_do_not_break_streaming(tok: Tokenizer) -> None:
    eot = tok.backend.token_to_id(ENDOFTEXT)
    ids = [*tok.encode("a b"), eot, eot, eot, *tok.encode(" c d")]
    _, deltas = _stream(tok, ids, SamplingParams())
    assert "".join(deltas) == "a b c d" == tok.decode(ids)


def test_tokenizer_folder_round_trip(tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(build_tokenizer_dir(tmp_path / "tok", vocab_size=300))
    text = "Emoji: 😀 🚀 and accents: façade."
    detok, deltas = _stream(tok, tok.encode(text), SamplingParams())
    assert "".join(deltas) == text
