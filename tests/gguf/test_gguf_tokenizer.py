"""The tokenizer of a GGUF file (`tokenizer.ggml.*` metadata) gives the ids of the tokenizer.json
it came from, pre-tokenizes as transformers' GGUF reader does for each supported
`tokenizer.ggml.pre`, and refuses what it cannot build, naming the field."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from ferrum.default_model import DEFAULT_MODEL_DIR
from ferrum.engine.tokenizer import Tokenizer
from tests.utils.gguf_files import ggml_vocab

TEXTS = [
    "To create a new table, use CREATE TABLE.",
    "Hello world 12345 and 7.5% of 2024",
    "  leading spaces\n\nnew lines\tand\ttabs   ",
    "don't WE'LL café naïve 日本語 🙂",
    "<|im_start|>user\nhi<|im_end|>\n",
]
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def _write(path: Path, arch: str = "qwen2", **fields: object) -> str:
    """A metadata-only GGUF file with the shipped model's vocabulary; `fields` override the
    tokenizer keys (tokenizer.ggml.NAME, with dots as underscores)."""
    tokens, types, merges = ggml_vocab(DEFAULT_MODEL_DIR)
    values = {
        "model": "gpt2",
        "pre": "gpt-2",
        "tokens": tokens,
        "token_type": types,
        "merges": merges,
        "eos_token_id": 2,
        "padding_token_id": 0,
        "add_bos_token": False,
    } | fields
    writer = gguf.GGUFWriter(str(path), arch)
    for name, value in values.items():
        key = f"tokenizer.ggml.{name}"
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    writer.add_string("tokenizer.chat_template", TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_ids_text_specials_and_template_match_the_source(tmp_path) -> None:
    tokenizer = Tokenizer.from_pretrained(_write(tmp_path / "t.gguf"))
    source = Tokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == source.encode(text), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.decode(source.encode(TEXTS[-1])) == "user\nhi\n"  # specials skipped
    assert tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 0
    assert tokenizer.vocab_size == source.vocab_size
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "[user] hi\n"


@pytest.mark.parametrize(
    ("arch", "pre", "add_bos"),
    [("qwen2", "qwen2", False), ("llama", "llama-bpe", True), ("qwen2", "gpt-2", False)],
)
def test_pre_tokenizers_match_transformers(tmp_path, arch: str, pre: str, add_bos: bool) -> None:
    """transformers builds its own tokenizer from the same file: the same ids, BOS included."""
    from transformers import AutoTokenizer

    path = _write(tmp_path / "t.gguf", arch, pre=pre, bos_token_id=1, add_bos_token=add_bos)
    ours = Tokenizer.from_pretrained(path)
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    for text in TEXTS:
        assert ours.encode(text) == reference(text)["input_ids"], (pre, text)
    assert (ours.encode("abc")[0] == 1) == add_bos


def test_the_pre_tokenizer_is_the_files(tmp_path) -> None:
    """Qwen2 splits digits one by one, Llama 3 in threes: the field changes the ids."""
    qwen2 = Tokenizer.from_pretrained(_write(tmp_path / "q.gguf", pre="qwen2"))
    llama3 = Tokenizer.from_pretrained(_write(tmp_path / "l.gguf", pre="llama-bpe"))
    assert len(qwen2.encode("123456")) == 6
    assert qwen2.encode("123456") != llama3.encode("123456")


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"model": "llama"}, "tokenizer.ggml.model 'llama' is not supported"),
        ({"pre": "falcon"}, "tokenizer.ggml.pre 'falcon' is not supported"),
        ({"merges": ["a b c"]}, "tokenizer.ggml.merges entry"),
        ({"token_type": [1, 1]}, "tokenizer.ggml.token_type has 2 entries"),
        ({"tokens": 7}, "tokenizer.ggml.tokens must be a list"),
    ],
)
def test_what_it_cannot_build_is_refused_naming_the_field(tmp_path, fields, named) -> None:
    path = _write(tmp_path / "t.gguf", **fields)
    with pytest.raises(ValueError, match=named) as error:
        Tokenizer.from_pretrained(path)
    assert path in str(error.value)
