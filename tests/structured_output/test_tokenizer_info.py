"""build_tokenizer_info: the model's vocab size, specials and padding never allowed, bytes right."""

from __future__ import annotations

import pytest
import xgrammar as xgr
from grammar_fixtures import MODEL_VOCAB_SIZE, STOP_TOKEN_IDS, TOKENIZER_VOCAB_SIZE
from tokenizers import AddedToken

from ferrum.default_model import DEFAULT_MODEL_DIR
from ferrum.engine.tokenizer import Tokenizer
from ferrum.structured_output import build_tokenizer_info


def test_vocab_is_the_models_with_specials_and_padding_excluded(tokenizer, tokenizer_info):
    assert tokenizer_info.vocab_size == MODEL_VOCAB_SIZE
    assert tokenizer_info.vocab_type is xgr.VocabType.BYTE_LEVEL
    assert sorted(tokenizer_info.stop_token_ids) == sorted(STOP_TOKEN_IDS)
    special = set(tokenizer_info.special_token_ids)
    assert set(range(TOKENIZER_VOCAB_SIZE, MODEL_VOCAB_SIZE)) <= special
    assert tokenizer.all_special_ids - set(STOP_TOKEN_IDS) <= special


def test_decoded_vocab_is_each_tokens_bytes(tokenizer, tokenizer_info):
    decoded = tokenizer_info.decoded_vocab
    checked = 0
    for token_id in range(TOKENIZER_VOCAB_SIZE):
        if token_id in tokenizer.all_special_ids:
            continue
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:  # part of a multi-byte character: not text on its own
            continue
        assert decoded[token_id] == text.encode("utf-8"), token_id
        checked += 1
    assert checked > TOKENIZER_VOCAB_SIZE - 300


def test_added_text_token_is_matched_as_its_text():
    tokenizer = Tokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    tokenizer.backend.add_tokens([AddedToken("<tool call>\n", special=False, normalized=False)])
    token_id = tokenizer.backend.token_to_id("<tool call>\n")
    info = build_tokenizer_info(tokenizer, vocab_size=token_id + 1, stop_token_ids=[2])
    assert info.decoded_vocab[token_id] == b"<tool call>\n"


def test_model_vocab_smaller_than_the_tokenizers_drops_the_extra_ids(tokenizer):
    info = build_tokenizer_info(tokenizer, vocab_size=4000, stop_token_ids=[2])
    assert info.vocab_size == 4000


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vocab_size": 0, "stop_token_ids": [2]}, "vocab_size must be an integer >= 1"),
        ({"vocab_size": 100, "stop_token_ids": []}, "stop_token_ids must name at least one"),
        ({"vocab_size": 100, "stop_token_ids": [100]}, r"stop_token_ids must be ids in \[0, 100\)"),
    ],
)
def test_bad_arguments_are_value_errors(tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_tokenizer_info(tokenizer, **kwargs)
