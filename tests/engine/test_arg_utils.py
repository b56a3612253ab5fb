"""EngineArgs takes its defaults, help and choices from the config dataclasses."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

from ferrum.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig
from ferrum.engine.arg_utils import EngineArgs


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
