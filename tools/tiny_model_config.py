"""Shape, special tokens, chat template and file writers of ferrum's shipped tiny Qwen3 model.

One source of truth for tools/train_tokenizer.py and tools/train_tiny_model.py; standard library
only, so it also runs on the device machine.
"""

from __future__ import annotations

import json
from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parent.parent / "ferrum" / "model_files" / "ferrum-tiny-qwen3"

VOCAB_SIZE = 8192
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# The trainer adds special tokens first, in this order, so their ids are 0, 1, 2.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
ENDOFTEXT_ID = 0
IM_START_ID = 1
IM_END_ID = 2

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

MODEL_CONFIG: dict[str, object] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 8,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
    "use_cache": True,
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": IM_END_ID,
    "pad_token_id": ENDOFTEXT_ID,
    "torch_dtype": "bfloat16",
}

GENERATION_CONFIG: dict[str, object] = {
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
    "pad_token_id": ENDOFTEXT_ID,
    "do_sample": True,
    "temperature": 0.8,
    "top_p": 0.95,
    "top_k": 50,
    "max_new_tokens": 128,
}

TOKENIZER_CONFIG: dict[str, object] = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": None,
    "eos_token": IM_END,
    "pad_token": ENDOFTEXT,
    "unk_token": None,
    "additional_special_tokens": [IM_START, IM_END],
    "add_bos_token": False,
    "add_eos_token": False,
    "clean_up_tokenization_spaces": False,
    "model_max_length": 2048,
    "chat_template": CHAT_TEMPLATE,
}


def _write_json(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def write_model_config_files(folder: Path) -> None:
    """Writes config.json and generation_config.json into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / "config.json", MODEL_CONFIG)
    _write_json(folder / "generation_config.json", GENERATION_CONFIG)


def write_tokenizer_config(folder: Path) -> None:
    """Writes tokenizer_config.json into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / "tokenizer_config.json", TOKENIZER_CONFIG)
