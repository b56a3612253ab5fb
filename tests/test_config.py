"""ModelConfig reads the model folder once and resolves its "auto" values;
StructuredOutputsConfig is validated, its errors name the field and the limit."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from ferrum.config import ModelConfig, StructuredOutputsConfig


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


def test_structured_outputs_config_defaults_are_valid() -> None:
    config = StructuredOutputsConfig()
    assert config.backend == "xgrammar" and config.compile_timeout_s == 10.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backend": "guidance"}, r"backend: must be one of \('xgrammar',\)"),
        ({"compile_timeout_s": 0}, r"compile_timeout_s: must be a number in \(0, 3600\]"),
        ({"compile_timeout_s": True}, "compile_timeout_s"),
        ({"compile_cache_size": 0}, "compile_cache_size: must be an integer >= 1"),
        ({"compile_max_workers": 1.5}, "compile_max_workers: must be an integer >= 1"),
    ],
)
def test_structured_outputs_config_invalid_fields_are_named(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsConfig(**kwargs)
