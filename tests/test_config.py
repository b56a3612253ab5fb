"""ModelConfig reads the model folder once and resolves its "auto" values;
StructuredOutputsConfig is validated, its errors name the field and the limit."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from ferrum.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
)


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


def test_parallel_config_resolves_the_executor_backend() -> None:
    assert ParallelConfig().distributed_executor_backend == "uni"
    assert ParallelConfig(tensor_parallel_size=2).distributed_executor_backend == "mp"
    assert ParallelConfig(2, distributed_executor_backend="mp").world_size == 2
    pipelined = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3)
    assert pipelined.distributed_executor_backend == "mp"
    assert (pipelined.world_size, pipelined.output_rank) == (6, 4)
    assert ParallelConfig(pipeline_parallel_size=2).distributed_executor_backend == "mp"
    ray_replicas = ParallelConfig(data_parallel_size=2, distributed_executor_backend="ray")
    assert ray_replicas.distributed_executor_backend == "ray"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size: must be an integer >= 1"),
        ({"tensor_parallel_size": True}, "tensor_parallel_size: must be an integer >= 1"),
        ({"distributed_executor_backend": "slurm"}, "distributed_executor_backend: must be one"),
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size: must be an integer >= 1"),
        (
            {"pipeline_parallel_size": 2, "distributed_executor_backend": "uni"},
            "distributed_executor_backend: 'uni' runs one rank",
        ),
        (
            {"tensor_parallel_size": 2, "distributed_executor_backend": "uni"},
            "distributed_executor_backend: 'uni' runs one rank",
        ),
    ],
)
def test_parallel_config_invalid_fields_are_named(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)


def _engine_config(path: str, **parallel: object) -> EngineConfig:
    model = ModelConfig(path)
    return EngineConfig(
        model_config=model,
        cache_config=CacheConfig(),
        scheduler_config=SchedulerConfig(max_model_len=model.max_model_len),
        parallel_config=ParallelConfig(**parallel),
    )


def test_parallel_config_must_split_the_model_exactly(tiny_checkpoint) -> None:
    # 4 heads, 2 KV heads, intermediate 96; the MoE model: 8 experts of width 32, layer 1 dense.
    llama, moe = tiny_checkpoint("llama"), tiny_checkpoint("qwen3_moe")
    assert _engine_config(llama, tensor_parallel_size=4).parallel_config.world_size == 4
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 must divide num_attention_he"):
        _engine_config(llama, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size: 8 must divide num_attention_he"):
        _engine_config(llama, tensor_parallel_size=8)
    assert _engine_config(llama, pipeline_parallel_size=2).parallel_config.world_size == 2
    with pytest.raises(ValueError, match="pipeline_parallel_size: 3 stages need at least as many"):
        _engine_config(llama, pipeline_parallel_size=3)  # 2 decoder layers
    with pytest.raises(ValueError, match="enable_expert_parallel: LlamaForCausalLM has no exp"):
        _engine_config(llama, enable_expert_parallel=True)
    for ep in (False, True):
        _engine_config(moe, tensor_parallel_size=4, enable_expert_parallel=ep)
    odd_kv = tiny_checkpoint("qwen3", num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ValueError, match="divide num_key_value_heads=3 or be a multiple of it"):
        _engine_config(odd_kv, tensor_parallel_size=2)
    _engine_config(odd_kv, tensor_parallel_size=6)  # each KV head replicated on two ranks
    wide = tiny_checkpoint("qwen3_moe", moe_intermediate_size=36, intermediate_size=98)
    with pytest.raises(ValueError, match="must divide intermediate_size=98"):
        _engine_config(wide, tensor_parallel_size=4)
    no_dense = tiny_checkpoint(
        "qwen3_moe", moe_intermediate_size=30, intermediate_size=30, mlp_only_layers=[]
    )
    with pytest.raises(ValueError, match="must divide moe_intermediate_size=30"):
        _engine_config(no_dense, tensor_parallel_size=4)
    _engine_config(no_dense, tensor_parallel_size=4, enable_expert_parallel=True)
    six_experts = tiny_checkpoint("qwen3_moe", num_experts=6)
    with pytest.raises(ValueError, match="must divide num_experts=6 with enable_expert_parallel"):
        _engine_config(six_experts, tensor_parallel_size=4, enable_expert_parallel=True)


def test_recurrent_snapshot_interval_rounds_up_to_whole_blocks() -> None:
    from ferrum.config import snapshot_interval_blocks

    assert snapshot_interval_blocks(CacheConfig(block_size=16)) == 4  # 64 tokens
    assert snapshot_interval_blocks(CacheConfig(block_size=16, recurrent_snapshot_interval=40)) == 3
    assert snapshot_interval_blocks(CacheConfig(block_size=16, recurrent_snapshot_interval=1)) == 2
    with pytest.raises(ValueError, match="recurrent_snapshot_interval: must be an integer >= 1"):
        CacheConfig(recurrent_snapshot_interval=0)
