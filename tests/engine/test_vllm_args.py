"""vLLM's engine arguments: the same names and the same answers from `LLM(...)`-style keywords
(EngineArgs) and from flags: accepted no-ops log one line, -O0 is enforce_eager, the values
ferrum cannot honour are refused naming the argument and why."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest

from ferrum.default_model import DEFAULT_MODEL_DIR
from ferrum.engine.arg_utils import EngineArgs
from ferrum.errors import FieldError


def _config(caplog: pytest.LogCaptureFixture, **kwargs: object):
    with caplog.at_level(logging.INFO, logger="ferrum"):
        return EngineArgs(DEFAULT_MODEL_DIR, device="cpu", **kwargs).create_engine_config()


def _flags(argv: list[str]) -> EngineArgs:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return EngineArgs.from_cli_args(parser.parse_args([DEFAULT_MODEL_DIR, *argv]), "unused")


@pytest.mark.parametrize(
    ("kwargs", "note"),
    [
        ({"enable_chunked_prefill": True}, "enable_chunked_prefill: has no effect"),
        ({"cpu_offload_gb": 0}, "cpu_offload_gb: has no effect"),
        ({"swap_space": 4}, "swap_space: has no effect"),
        ({"trust_remote_code": True}, "trust_remote_code: has no effect"),
        ({"max_seq_len_to_capture": 8192}, "max_seq_len_to_capture: has no effect"),
        ({"optimization_level": 3}, "optimization_level 3 (-O3): has no effect"),
    ],
)
def test_accepted_no_ops_say_so_once(
    kwargs: dict[str, object], note: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(caplog, **kwargs)
    assert [r.getMessage() for r in caplog.records if note in r.getMessage()] != []
    assert sum(note in r.getMessage() for r in caplog.records) == 1
    assert not config.device_config.enforce_eager


def test_nothing_is_logged_for_unset_vllm_arguments(caplog: pytest.LogCaptureFixture) -> None:
    _config(caplog, trust_remote_code=False, tokenizer_mode="auto", disable_log_stats=True)
    assert not [r for r in caplog.records if "has no effect" in r.getMessage()]


def test_o0_turns_cuda_graphs_off(caplog: pytest.LogCaptureFixture) -> None:
    assert _config(caplog, optimization_level=0).device_config.enforce_eager
    assert _flags(["-O0"]).optimization_level == 0
    assert _flags(["-O", "2"]).optimization_level == 2
    assert _flags(["--optimization-level", "1"]).optimization_level == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"enable_chunked_prefill": False}, "enable_chunked_prefill: False is not supported: "),
        ({"cpu_offload_gb": 4}, "cpu_offload_gb: 4 GiB: not supported yet"),
        ({"cpu_offload_gb": -1}, "cpu_offload_gb: must be >= 0"),
        ({"swap_space": "a"}, "swap_space: must be a number of GiB"),
        ({"tokenizer_mode": "mistral"}, "tokenizer_mode: 'mistral' is not supported"),
        ({"optimization_level": 4}, "optimization_level: must be 0, 1, 2 or 3"),
        ({"max_logprobs": -2}, "max_logprobs: must be an integer >= -1"),
        ({"generation_config": "/no/such"}, "generation_config: '/no/such' is not a folder"),
    ],
)
def test_what_ferrum_cannot_honour_is_refused_by_name(
    kwargs: dict[str, object], message: str, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(FieldError, match=message.replace("(", r"\(")):
        _config(caplog, **kwargs)


def test_flags_and_keywords_share_names() -> None:
    args = _flags(
        ["--enable-chunked-prefill", "--cpu-offload-gb", "0", "--swap-space", "4"]
        + ["--trust-remote-code", "--disable-log-stats", "--max-logprobs", "5"]
        + ["--tokenizer-mode", "hf", "--max-seq-len-to-capture", "8192"]
        + ["--generation-config", "vllm"]
    )
    assert args == EngineArgs(
        DEFAULT_MODEL_DIR,
        enable_chunked_prefill=True,
        cpu_offload_gb=0,
        swap_space=4,
        trust_remote_code=True,
        disable_log_stats=True,
        max_logprobs=5,
        tokenizer_mode="hf",
        max_seq_len_to_capture=8192,
        generation_config="vllm",
    )
    assert _flags(["--no-enable-chunked-prefill"]).enable_chunked_prefill is False


def test_max_logprobs_resolves_to_ferrums_ceiling(caplog: pytest.LogCaptureFixture) -> None:
    assert _config(caplog).model_config.max_logprobs == 20
    assert _config(caplog, max_logprobs=3).model_config.max_logprobs == 3
    caplog.clear()
    assert _config(caplog, max_logprobs=-1).model_config.max_logprobs == 20
    assert any("at most 20 logprobs" in r.getMessage() for r in caplog.records)
    assert _config(caplog, max_logprobs=100).model_config.max_logprobs == 20


def test_generation_config_picks_the_sampling_defaults(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    auto = _config(caplog).model_config
    assert auto.default_sampling_kwargs()["temperature"] == 0.8  # the shipped model's file
    vllm = _config(caplog, generation_config="vllm").model_config
    assert vllm.default_sampling_kwargs() == {}
    assert vllm.eos_token_ids() == auto.eos_token_ids()  # EOS ids still come from the file
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    folder = _config(caplog, generation_config=str(tmp_path)).model_config
    assert folder.default_sampling_kwargs() == {"temperature": 0.3}
