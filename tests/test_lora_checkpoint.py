"""PEFT adapter folders ferrum refuses, each with a FieldError("lora_request") naming why, and
the LoRA limits' validation (`lora_config.py`); the LLM refuses them before anything runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ferrum import LoRARequest
from ferrum.errors import FieldError
from ferrum.lora_checkpoint import read_adapter
from ferrum.lora_config import LoRAConfig
from ferrum.model_arch import ModelArchConfig
from ferrum.model_folder import read_hf_config
from tests.utils.tiny_llm import make_llm


def _arch(path: str) -> ModelArchConfig:
    return ModelArchConfig.from_hf_config(read_hf_config(path))


@pytest.fixture
def adapter_copy(peft_adapter, tmp_path):
    def copy(**options) -> Path:
        target = tmp_path / "adapter"
        shutil.copytree(peft_adapter("llama", **options), target)
        return target

    return copy


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(config | changes))


def test_a_valid_adapter_is_read(tiny_checkpoint, peft_adapter) -> None:
    spec = read_adapter(
        peft_adapter("llama", rank=4, alpha=8.0), _arch(tiny_checkpoint("llama")), 8
    )
    assert (spec.rank, spec.scaling) == (4, 2.0)
    assert {(t.module, t.shard) for t in spec.tensors} >= {
        ("self_attn.qkv_proj", "q"),
        ("mlp.gate_up_proj", "up"),
        ("mlp.down_proj", None),
    }
    rs = read_adapter(
        peft_adapter("llama", rank=4, alpha=8.0, use_rslora=True),
        _arch(tiny_checkpoint("llama")),
        8,
    )
    assert rs.scaling == 4.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "DoRA adapters are not supported"),
        ({"r": 32}, "rank 32 exceeds max_lora_rank=8"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, r"target_modules \['embed_tokens'\]"),
        ({"target_modules": ["q_proj", 3, None]}, r"target_modules \['3', 'None'\]"),
        ({"r": "8"}, "r: must be an integer >= 1"),
        ({"lora_alpha": [1]}, "lora_alpha: must be a number"),
        ({"bias": "all"}, "adapters with biases are not supported"),
        ({"peft_type": "IA3"}, "only LORA is served"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ],
)
def test_refused_configs_say_why(tiny_checkpoint, adapter_copy, change, message) -> None:
    folder = adapter_copy(rank=4)
    _edit_config(folder, **change)
    with pytest.raises(FieldError, match=message) as info:
        read_adapter(str(folder), _arch(tiny_checkpoint("llama")), 8)
    assert info.value.field == "lora_request"


def test_refused_files_say_why(tiny_checkpoint, adapter_copy, tmp_path) -> None:
    arch = _arch(tiny_checkpoint("llama"))
    folder = adapter_copy(rank=4)
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(FieldError, match="is truncated or malformed"):
        read_adapter(str(folder), arch, 8)
    (folder / "adapter_model.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(FieldError, match="not a safetensors file"):
        read_adapter(str(folder), arch, 8)
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(FieldError, match="adapter_model.safetensors is missing"):
        read_adapter(str(folder), arch, 8)
    (folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(FieldError, match="adapter_config.json is not valid JSON"):
        read_adapter(str(folder), arch, 8)
    with pytest.raises(FieldError, match="not a folder"):
        read_adapter(str(tmp_path / "nowhere"), arch, 8)


def test_another_base_model_and_unknown_modules_are_refused(tiny_checkpoint, peft_adapter) -> None:
    qwen3_adapter = peft_adapter("qwen3", rank=4)
    # The tiny qwen3 has other head counts than the tiny llama: the shapes differ.
    with pytest.raises(FieldError, match="an adapter of another base model"):
        read_adapter(qwen3_adapter, _arch(tiny_checkpoint("llama", intermediate_size=64)), 8)
    lm_head = peft_adapter("llama", rank=4, targets=("q_proj", "lm_head"))
    with pytest.raises(FieldError, match="ferrum has no LoRA for"):
        read_adapter(lm_head, _arch(tiny_checkpoint("llama")), 8)
    # MLP tensors against a MoE base (PEFT itself cannot target one of its fused experts).
    with pytest.raises(FieldError, match="MoE experts"):
        read_adapter(peft_adapter("llama", rank=4), _arch(tiny_checkpoint("qwen3_moe")), 8)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_loras": 0}, "max_loras: must be an integer >= 1, got 0"),
        ({"max_lora_rank": 1024}, "max_lora_rank: must be <= 512, got 1024"),
        ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras: must be >= max_loras=4"),
    ],
)
def test_limits_are_validated(kwargs, message) -> None:
    with pytest.raises(FieldError, match=message):
        LoRAConfig(enable_lora=True, **kwargs)


def test_vllm_lora_arguments_ferrum_lacks_are_refused_unless_off() -> None:
    from ferrum.engine.arg_utils import check_not_supported_yet

    check_not_supported_yet({"fully_sharded_loras": False, "lora_dtype": "auto"})
    with pytest.raises(ValueError, match="fully_sharded_loras=True: not supported yet"):
        check_not_supported_yet({"fully_sharded_loras": True})


def test_llm_refuses_adapters_it_cannot_serve(tiny_checkpoint, peft_adapter) -> None:
    base = tiny_checkpoint("llama")
    adapter = LoRARequest("a", 1, peft_adapter("llama", rank=4))
    prompt = [{"prompt_token_ids": [1, 2, 3]}]
    plain = make_llm(base, num_kv_blocks=16)
    with pytest.raises(FieldError, match="need enable_lora=True"):
        plain.generate(prompt, use_tqdm=False, lora_request=adapter)
    llm = make_llm(base, enable_lora=True, max_lora_rank=2, num_kv_blocks=16)
    with pytest.raises(FieldError, match="rank 4 exceeds max_lora_rank=2"):
        llm.generate(prompt, use_tqdm=False, lora_request=adapter)
    with pytest.raises(ValueError, match="lora_request: got 2 for 1 prompts"):
        llm.generate(prompt, use_tqdm=False, lora_request=[None, None])
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(FieldError, match="enable_lora: not supported for Qwen3_5ForCausalLM"):
        make_llm(tiny_checkpoint("qwen3_5"), enable_lora=True)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"dtype": "F32", "shape": 5, "data_offsets": [0, 4]}, "expected \\[4, 64\\]"),
        ({"dtype": "F32", "shape": [4, 64], "data_offsets": "x"}, "truncated or malformed"),
        ({"dtype": "I8", "shape": [4, 64], "data_offsets": [0, 4]}, "dtype 'I8'"),
        ([1, 2], "truncated or malformed"),
    ],
)
def test_hostile_safetensors_headers_are_refusals(
    tiny_checkpoint, adapter_copy, entry, message
) -> None:
    folder = adapter_copy(rank=4)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    header = json.dumps({key: entry}).encode()
    weights = len(header).to_bytes(8, "little") + header + b"\x00" * 4
    (folder / "adapter_model.safetensors").write_bytes(weights)
    with pytest.raises(FieldError, match=message):
        read_adapter(str(folder), _arch(tiny_checkpoint("llama")), 8)
