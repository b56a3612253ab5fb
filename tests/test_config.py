"""ModelConfig reads the model folder once and resolves its "auto" values."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from ferrum.config import ModelConfig


def test_model_config_reads_the_folder_once(tiny_checkpoint, tmp_path) -> None:
    folder = shutil.copytree(tiny_checkpoint("qwen3"), tmp_path / "model")
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"temperature": 0.7, "max_new_tokens": 9, "eos_token_id": [2, 5]}, f)
    config = ModelConfig(str(folder))
    assert (config.dtype, config.max_model_len, config.tokenizer) == ("float32", 256, str(folder))
    assert config.arch.architecture == "Qwen3ForCausalLM" and config.vocab_size == 384
    os.remove(os.path.join(folder, "generation_config.json"))
    assert config.default_sampling_kwargs() == {"temperature": 0.7, "max_tokens": 9}
    assert config.eos_token_ids() == [2, 5]


def test_model_config_errors_name_the_field(tiny_checkpoint, tmp_path) -> None:
    path = tiny_checkpoint("qwen3")
    with pytest.raises(ValueError, match="max_model_len: 512 exceeds"):
        ModelConfig(path, max_model_len=512)
    with pytest.raises(ValueError, match="load_format: must be one of"):
        ModelConfig(path, load_format="gguf")
    with pytest.raises(ValueError, match="dtype: must be 'auto' or one of"):
        ModelConfig(path, dtype="int8")
    with pytest.raises(ValueError, match="is not a local model folder"):
        ModelConfig(str(tmp_path / "missing"))
