"""EngineArgs takes its defaults, help and choices from the config dataclasses."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

import pytest
import torch

from ferrum.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    SchedulerConfig,
)
from ferrum.default_model import DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME
from ferrum.engine.arg_utils import (
    NOT_SUPPORTED_YET,
    EngineArgs,
    add_config_args,
    check_not_supported_yet,
    config_from_args,
)
from ferrum.recovery_config import EngineRecoveryConfig


def test_every_config_knob_is_an_engine_arg_with_the_config_default() -> None:
    args = {f.name: f for f in fields(EngineArgs)}
    for config_class in (ModelConfig, CacheConfig, SchedulerConfig, DeviceConfig):
        for f in fields(config_class):
            if not f.init or f.name == "max_model_len" and config_class is SchedulerConfig:
                continue
            assert f.name in args, f.name
            if f.name not in ("device", "async_scheduling"):  # None: chosen from the hardware
                assert args[f.name].default == f.default, f.name


def test_cli_flags_carry_config_help_default_and_choices() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    actions = {a.dest: a for a in parser._actions}
    assert actions["block_size"].default == CacheConfig.block_size
    assert actions["block_size"].help.startswith("tokens per KV cache block (default: 16)")
    assert actions["kernel_backend"].choices == ("auto", "torch", "triton")
    assert actions["load_format"].choices == ("auto", "safetensors", "dummy")
    for f in fields(EngineArgs):
        assert actions[f.name].help, f.name
    assert all(f.default is not MISSING for f in fields(EngineArgs) if f.name != "model")


def test_triton_on_the_cpu_runs_bfloat16_checkpoints_in_float32() -> None:
    # The shipped checkpoint is bfloat16, which Triton's CPU interpreter cannot run.
    args = EngineArgs(model=DEFAULT_MODEL_DIR, device="cpu", kernel_backend="triton")
    assert args.create_engine_config().model_config.dtype == "float32"
    assert (
        EngineArgs(model=DEFAULT_MODEL_DIR, device="cpu").create_engine_config().model_config.dtype
        == "bfloat16"
    )
    with pytest.raises(
        ValueError, match="dtype: bfloat16 does not run in Triton's CPU interpreter"
    ):
        args.replace(dtype="bfloat16").create_engine_config()


def test_the_shipped_models_name_resolves_to_its_folder() -> None:
    config = EngineArgs(model=DEFAULT_MODEL_NAME, device="cpu").create_engine_config()
    assert config.model_config.model == DEFAULT_MODEL_DIR


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_fails_before_loading() -> None:
    with pytest.raises(ValueError, match="device: 'cuda:1' was asked for, but this torch build"):
        EngineArgs(model=DEFAULT_MODEL_DIR, device="cuda:1").create_engine_config()
    # The Ray backend's GPUs are the cluster's, maybe on other nodes: no local check.
    ray = EngineArgs(
        model=DEFAULT_MODEL_DIR,
        device="cuda",
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
    )
    assert ray.create_engine_config().device_config.device == "cuda"


def test_vllm_arguments_not_supported_yet() -> None:
    check_not_supported_yet({"revision": None, "rope_scaling": None})  # "off": fine
    with pytest.raises(ValueError, match="revision='main': not supported yet by ferrum"):
        check_not_supported_yet({"revision": "main"})
    with pytest.raises(TypeError, match="unexpected engine argument 'max_num_seq'.*max_num_seqs"):
        check_not_supported_yet({"max_num_seq": 4})
    assert not set(NOT_SUPPORTED_YET) & {f.name for f in fields(EngineArgs)}


def test_parallel_flags_build_the_parallel_config() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args([DEFAULT_MODEL_DIR, "-tp", "2", "--device", "cpu"])
    config = EngineArgs.from_cli_args(args, DEFAULT_MODEL_DIR).create_engine_config()
    assert config.parallel_config.tensor_parallel_size == 2
    assert config.parallel_config.distributed_executor_backend == "mp"
    assert not config.parallel_config.disable_custom_all_reduce
    args = parser.parse_args([DEFAULT_MODEL_DIR, "-tp", "2", "--disable-custom-all-reduce"])
    config = EngineArgs.from_cli_args(args, DEFAULT_MODEL_DIR).create_engine_config()
    assert config.parallel_config.disable_custom_all_reduce
    args = parser.parse_args([DEFAULT_MODEL_DIR, "--distributed-executor-backend", "mp"])
    config = EngineArgs.from_cli_args(args, DEFAULT_MODEL_DIR).create_engine_config()
    assert config.parallel_config.tensor_parallel_size == 1
    assert config.parallel_config.distributed_executor_backend == "mp"
    default = EngineArgs(model=DEFAULT_MODEL_DIR, device="cpu").create_engine_config()
    assert default.parallel_config.distributed_executor_backend == "uni"
    ray = EngineArgs(model=DEFAULT_MODEL_DIR, device="cpu", distributed_executor_backend="ray")
    assert ray.create_engine_config().parallel_config.distributed_executor_backend == "ray"


def test_batch_invariant_flag_builds_the_device_config() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args([DEFAULT_MODEL_DIR, "--device", "cpu", "--batch-invariant"])
    config = EngineArgs.from_cli_args(args, DEFAULT_MODEL_DIR).create_engine_config()
    assert config.device_config.batch_invariant
    default = EngineArgs(model=DEFAULT_MODEL_DIR, device="cpu").create_engine_config()
    assert not default.device_config.batch_invariant


def test_engine_recovery_flags_build_a_validated_config() -> None:
    parser = argparse.ArgumentParser()
    add_config_args(parser, EngineRecoveryConfig)
    assert config_from_args(EngineRecoveryConfig, parser.parse_args([])) == EngineRecoveryConfig()
    args = parser.parse_args(
        [
            "--engine-failure-policy",
            "exit",
            "--engine-max-restarts",
            "2",
            "--engine-restart-window",
            "30",
            "--engine-stall-timeout",
            "5.5",
        ]
    )
    assert config_from_args(EngineRecoveryConfig, args) == EngineRecoveryConfig(
        "exit", 2, 30.0, 5.5
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--engine-failure-policy", "retry"])
    with pytest.raises(ValueError, match="engine_stall_timeout: must be a number of seconds > 0"):
        config_from_args(EngineRecoveryConfig, parser.parse_args(["--engine-stall-timeout", "0"]))
    with pytest.raises(ValueError, match="engine_max_restarts: must be an integer >= 0"):
        EngineRecoveryConfig(engine_max_restarts=-1)
