from __future__ import annotations

import json
from pathlib import Path

import pytest

from ferrum.engine.tokenizer import RELEASE_GIL_MIN_CHARS, RELEASE_GIL_MIN_TOKENS, Tokenizer
from tests.utils.tokenizer_files import (
    BEGIN_OF_TEXT,
    ENDOFTEXT,
    IM_END,
    IM_START,
    build_tokenizer_dir,
)

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "",
    "  leading and trailing spaces  ",
    f"{IM_START}user\nhi{IM_END}\n{IM_START}assistant\n",
    f"text{ENDOFTEXT}more text",
    "日本語のテキスト 😀 👍🏽 café",
    "def main():\n\tprint('x')\r\n",
    "<|im_start without closing",
]


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer_dir(tmp_path_factory.mktemp("chatml"))


@pytest.fixture(scope="module")
def bos_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer_dir(
        tmp_path_factory.mktemp("bos"), bos_token=BEGIN_OF_TEXT, add_bos=True
    )


@pytest.mark.parametrize("variant", ["chatml_dir", "bos_dir"])
def test_encode_decode_match_transformers(variant: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(variant)
    ours = Tokenizer.from_pretrained(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path))
    for text in TEXTS:
        for add_special in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special)
            assert ids == theirs(text, add_special_tokens=add_special)["input_ids"], text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                    ids, skip_special_tokens=skip
                )


@pytest.mark.parametrize("variant", ["chatml_dir", "bos_dir"])
def test_special_token_attributes_match_transformers(
    variant: str, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(variant)
    ours = Tokenizer.from_pretrained(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path))
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.pad_token_id == theirs.pad_token_id
    assert ours.vocab_size == len(theirs)
    assert set(theirs.all_special_ids) <= ours.all_special_ids
    # Added tokens flagged special count too: they are what skip_special_tokens drops.
    assert ours.backend.token_to_id(IM_START) in ours.all_special_ids


def test_bos_tokenizer_prepends_bos(bos_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(bos_dir)
    bos = tok.backend.token_to_id(BEGIN_OF_TEXT)
    assert tok.bos_token_id == bos
    assert tok.encode("hi")[0] == bos
    assert bos not in tok.encode("hi", add_special_tokens=False)
    assert tok.decode(tok.encode("hi")) == "hi"
    assert tok.decode(tok.encode("hi"), skip_special_tokens=False) == BEGIN_OF_TEXT + "hi"


def test_add_bos_token_in_config_defers_to_tokenizer_json(tmp_path: Path) -> None:
    path = build_tokenizer_dir(tmp_path / "tok", bos_token=BEGIN_OF_TEXT, add_bos=False)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(add_bos_token=True, add_eos_token=True)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_pretrained(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path))
    ids = ours.encode("hello there")
    assert ids == theirs("hello there")["input_ids"]
    assert ours.bos_token_id not in ids and ours.eos_token_id not in ids


def test_special_tokens_map_overrides_config(tmp_path: Path) -> None:
    path = build_tokenizer_dir(tmp_path / "tok", eos_token=IM_END)
    (path / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": {"content": ENDOFTEXT, "special": True}})
    )
    ours = Tokenizer.from_pretrained(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path))
    assert ours.eos_token_id == theirs.eos_token_id == ours.backend.token_to_id(ENDOFTEXT)


def test_named_special_token_missing_from_vocab_is_added(tmp_path: Path) -> None:
    path = build_tokenizer_dir(tmp_path / "tok", pad_token="<pad>")
    ours = Tokenizer.from_pretrained(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path))
    assert ours.pad_token_id == theirs.pad_token_id
    assert ours.vocab_size == len(theirs)
    assert ours.encode("a<pad>b") == theirs("a<pad>b")["input_ids"]
    assert ours.decode(ours.encode("a<pad>b")) == "ab"


def test_missing_tokenizer_json_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_corrupt_files_raise(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    path = build_tokenizer_dir(tmp_path / "tok")
    (path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_pretrained(path)


def test_encode_rejects_non_text(chatml_dir: Path) -> None:
    with pytest.raises(ValueError, match="text"):
        Tokenizer.from_pretrained(chatml_dir).encode([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("variant", ["chatml_dir", "bos_dir"])
def test_long_inputs_take_the_gil_free_path_with_the_same_result(
    variant: str, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(variant)
    ours = Tokenizer.from_pretrained(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path))
    text = " ".join(TEXTS) * (RELEASE_GIL_MIN_CHARS // 40)
    assert len(text) >= RELEASE_GIL_MIN_CHARS
    ids = ours.encode(text)
    assert ids == theirs(text)["input_ids"]
    assert len(ids) >= RELEASE_GIL_MIN_TOKENS
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)
    with pytest.raises(ValueError, match="not valid Unicode"):
        ours.encode("x\ud800" * RELEASE_GIL_MIN_CHARS)


def test_max_token_chars_bounds_characters_per_token(chatml_dir: Path) -> None:
    tokenizer = Tokenizer.from_pretrained(chatml_dir)
    longest = max(tokenizer.backend.get_vocab(with_added_tokens=True), key=len)
    assert tokenizer.max_token_chars == len(longest)
    for text in [*TEXTS, " ".join(TEXTS) * 50, "a" * 5000, " " * 5000]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(text) <= len(ids) * tokenizer.max_token_chars
