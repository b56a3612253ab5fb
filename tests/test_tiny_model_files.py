"""The shipped model folder ferrum/model_files/ferrum-tiny-qwen3 is a valid, trained HF Qwen3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

MODEL_DIR = Path(__file__).resolve().parent.parent / "ferrum" / "model_files" / "ferrum-tiny-qwen3"
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
)
MAX_WEIGHTS_BYTES = 40 * 1024 * 1024
MAX_FOLDER_BYTES = 42 * 1024 * 1024
ENGLISH = "The database server writes each change to the log before the table is updated."


def _json(name: str) -> dict:
    return json.loads((MODEL_DIR / name).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(MODEL_DIR))


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32)
    return model.eval()


def test_folder_has_all_files_within_size_limits() -> None:
    for name in REQUIRED_FILES:
        assert (MODEL_DIR / name).is_file(), name
    assert (MODEL_DIR / "model.safetensors").stat().st_size <= MAX_WEIGHTS_BYTES
    assert sum(p.stat().st_size for p in MODEL_DIR.iterdir()) <= MAX_FOLDER_BYTES


def test_config_is_qwen3_bf16_with_tied_embeddings() -> None:
    config = _json("config.json")
    assert config["model_type"] == "qwen3"
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["torch_dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is True
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
    assert config["max_position_embeddings"] >= 2048


def test_weights_are_bf16_and_10_to_30_million_parameters() -> None:
    config = _json("config.json")
    num_params = 0
    with safe_open(str(MODEL_DIR / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        for name in names:
            tensor = f.get_tensor(name)
            assert tensor.dtype == torch.bfloat16, name
            assert torch.isfinite(tensor.float()).all(), name
            num_params += tensor.numel()
    assert 10_000_000 <= num_params <= 30_000_000
    assert "lm_head.weight" not in names
    embed_shape = (config["vocab_size"], config["hidden_size"])
    with safe_open(str(MODEL_DIR / "model.safetensors"), framework="pt") as f:
        assert tuple(f.get_slice("model.embed_tokens.weight").get_shape()) == embed_shape
    last = config["num_hidden_layers"] - 1
    assert f"model.layers.{last}.self_attn.q_norm.weight" in names
    assert f"model.layers.{last + 1}.self_attn.q_norm.weight" not in names


def test_tokenizer_json_special_tokens_and_round_trip() -> None:
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == _json("config.json")["vocab_size"]
    special = {t: tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert special == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    ids = tokenizer.encode(ENGLISH, add_special_tokens=False).ids
    assert len(ids) < len(ENGLISH) / 3  # BPE merges learned on English prose
    assert tokenizer.decode(ids) == ENGLISH
    assert tokenizer.encode("<|im_start|>user", add_special_tokens=False).ids[0] == 1


def test_generation_config_stops_on_im_end_and_endoftext() -> None:
    generation = _json("generation_config.json")
    assert generation["eos_token_id"] == [2, 0]
    assert generation["pad_token_id"] == 0


def test_auto_tokenizer_chat_template_renders_chatml(hf_tokenizer) -> None:
    assert hf_tokenizer.eos_token == "<|im_end|>"
    assert hf_tokenizer.pad_token == "<|endoftext|>"
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a database."},
        {"role": "assistant", "content": "SQLite."},
        {"role": "user", "content": "Another?"},
    ]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nName a database.<|im_end|>\n"
        "<|im_start|>assistant\nSQLite.<|im_end|>\n"
        "<|im_start|>user\nAnother?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = hf_tokenizer.apply_chat_template(messages[:2], tokenize=False)
    assert not without.endswith("<|im_start|>assistant\n")
    ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(1) == 5 and ids.count(2) == 4


def test_auto_model_loads_and_is_trained(hf_tokenizer, hf_model) -> None:
    assert type(hf_model).__name__ == "Qwen3ForCausalLM"
    ids = torch.tensor([hf_tokenizer(ENGLISH)["input_ids"]])
    with torch.no_grad():
        loss = hf_model(ids, labels=ids).loss.item()
    # Uniform guessing over 8192 tokens gives ln(8192) = 9.0; the trained model is far better.
    assert loss < 5.0


def test_greedy_generation_is_deterministic_english(hf_tokenizer, hf_model) -> None:
    prompt = hf_tokenizer("The table", return_tensors="pt")
    runs = [
        hf_model.generate(**prompt, max_new_tokens=12, do_sample=False)[0].tolist()
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    text = hf_tokenizer.decode(runs[0][prompt["input_ids"].shape[1] :])
    letters = sum(c.isascii() and (c.isalpha() or c.isspace()) for c in text)
    assert len(text) > 12 and letters >= 0.8 * len(text)
