"""`ferrum bench latency` / `ferrum bench throughput` and benchmarks/run_workloads.py on a tiny
dummy-weight config on the CPU: every figure is present and counts what was asked."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from ferrum.bench import latency, throughput, workloads
from ferrum.config import ModelConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN_WORKLOADS = REPO_ROOT / "benchmarks" / "run_workloads.py"
ENGINE_FLAGS = [
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--num-kv-blocks",
    "256",
    "--load-format",
    "dummy",
]
# Smaller than the recipes' id range (0..10000), so prompts go through fold_to_vocab.
TINY_VOCAB = 4096


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("tiny_qwen3")
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "eos_token_id": 2,
    }
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return str(folder)


def _parse(module: ModuleType, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_cli_args(parser)
    return parser.parse_args(argv)


def test_latency_batch_of_one_reports_ttft_and_tpot(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "latency.json"
    args = _parse(
        latency,
        [
            tiny_model,
            *ENGINE_FLAGS,
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--batch-size",
            "1",
            "--num-iters-warmup",
            "1",
            "--num-iters",
            "3",
            "--output-json",
            str(out),
        ],
    )
    assert args.skip_tokenizer_init  # token-id prompts: a config folder without tokenizer works
    assert latency.main(args) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "Avg latency:" in printed and "99% percentile latency:" in printed
    assert "Timed iterations: 100%" in captured.err and "Warm-up iterations" in captured.err
    assert "TTFT (median):" in printed and "TPOT (median):" in printed
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 3 and len(result["ttft_latencies"]) == 3
    assert result["avg_latency"] == pytest.approx(sum(result["latencies"]) / 3)
    assert list(result["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert min(result["latencies"]) <= result["percentiles"]["50"] <= max(result["latencies"])
    assert result["ttft_s"] > 0
    expected_tpot = (latency.median(result["latencies"]) - result["ttft_s"]) / 3
    assert result["tpot_s"] == pytest.approx(expected_tpot)
    assert result["bench_args"]["output_len"] == 4
    assert result["engine_args"]["load_format"] == "dummy"


def test_latency_batch_with_n_has_no_ttft(tiny_model: str, tmp_path: Path) -> None:
    out = tmp_path / "latency.json"
    args = _parse(
        latency,
        [
            tiny_model,
            *ENGINE_FLAGS,
            "--input-len",
            "5",
            "--output-len",
            "3",
            "--batch-size",
            "2",
            "--n",
            "2",
            "--num-iters-warmup",
            "0",
            "--num-iters",
            "2",
            "--output-json",
            str(out),
        ],
    )
    assert latency.main(args) == 0
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 2 and "ttft_s" not in result
    assert result["bench_args"]["n"] == 2


def test_throughput_random_counts_every_token(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "throughput.json"
    args = _parse(
        throughput,
        [
            tiny_model,
            *ENGINE_FLAGS,
            "--num-prompts",
            "3",
            "--input-len",
            "8",
            "--output-len",
            "5",
            "--output-json",
            str(out),
        ],
    )
    assert throughput.main(args) == 0
    captured = capsys.readouterr()
    assert "requests/s" in captured.out
    # generate's progress bar: prompts done and the token rates.
    assert "Processed prompts: 100%" in captured.err and "est. speed input:" in captured.err
    result = json.loads(out.read_text())
    assert (result["num_requests"], result["num_prompt_tokens"]) == (3, 24)
    assert (result["num_output_tokens"], result["total_num_tokens"]) == (15, 39)
    assert result["output_tokens_per_second"] == pytest.approx(15 / result["elapsed_time"])
    assert result["tokens_per_second"] == pytest.approx(39 / result["elapsed_time"])
    assert result["requests_per_second"] == pytest.approx(3 / result["elapsed_time"])
    assert result["num_cached_prompt_tokens"] == 0
    assert result["bench_args"]["temperature"] == 1.0


def test_throughput_nano_follows_the_recipe(tiny_model: str, tmp_path: Path) -> None:
    out = tmp_path / "nano.json"
    args = _parse(
        throughput,
        [
            tiny_model,
            *ENGINE_FLAGS,
            "--dataset-name",
            "nano",
            "--num-prompts",
            "2",
            "--input-len",
            "110",
            "--output-len",
            "101",
            "--seed",
            "3",
            "--output-json",
            str(out),
        ],
    )
    assert throughput.main(args) == 0
    prompts, output_lens = workloads.nano(seed=3, num_seqs=2, max_in=110, max_out=101)
    result = json.loads(out.read_text())
    assert result["num_prompt_tokens"] == sum(len(p) for p in prompts)
    assert result["num_output_tokens"] == sum(output_lens)
    assert result["bench_args"]["temperature"] == 0.6


@pytest.mark.parametrize(
    ("module", "argv", "message"),
    [
        (latency, ["--input-len", "0"], "input_len must be >= 1"),
        (latency, ["--num-iters-warmup", "-1"], "num_iters_warmup must be >= 0"),
        (throughput, ["--num-prompts", "0"], "num_prompts must be >= 1"),
        (throughput, ["--dataset-name", "nano", "--input-len", "99"], "input_len must be >= 100"),
    ],
)
def test_bad_bench_flags_name_the_field(
    module: ModuleType, argv: list[str], message: str, tiny_model: str
) -> None:
    with pytest.raises(ValueError, match=message):
        module.main(_parse(module, [tiny_model, *ENGINE_FLAGS, *argv]))


def test_run_workloads_writes_every_figure(tiny_model: str, tmp_path: Path) -> None:
    out = tmp_path / "results" / "tiny.json"
    command = [
        sys.executable,
        str(RUN_WORKLOADS),
        "--model",
        tiny_model,
        *ENGINE_FLAGS,
        "--scale",
        "0.01",
        "--lat-iters",
        "2",
        "--lat-warmup",
        "1",
        "--out",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    for key in ("device_name", "torch_version", "git_commit", "date", "engine_args"):
        assert key in report
    assert report["device"] == "cpu" and report["model"] == tiny_model
    assert report["engine_args"]["load_format"] == "dummy"
    assert report["engine_args"]["skip_tokenizer_init"] is True
    assert 0 < report["engine_init_s"] < report["startup_s"] < report["total_s"]
    assert list(report["workloads"]) == ["lat", "c16", "c64", "nano"]
    lat = report["workloads"]["lat"]
    assert (lat["input_len"], lat["output_len"]) == (1, 6)
    assert len(lat["t_first_s"]) == len(lat["t_full_s"]) == 2
    assert lat["ttft_ms"] > 0
    for name in ("c16", "c64"):
        figures = report["workloads"][name]
        assert figures["num_output_tokens"] == figures["num_prompts"] * figures["output_len"]
        assert figures["output_tokens_per_second"] > 0
    nano = report["workloads"]["nano"]
    _, output_lens = workloads.nano(seed=0, num_seqs=3, max_in=100, max_out=100)
    assert (nano["num_prompts"], nano["num_output_tokens"]) == (3, sum(output_lens))
    assert nano["elapsed_time"] > 0 and nano["temperature"] == 0.6


def test_run_workloads_long_context_rows(tiny_model: str, tmp_path: Path) -> None:
    """`long` (32 x 4,000-token prompts, 128 out), `decode8k` (decode rate at 8k context) and
    the next turns (`turn16`, `turn64`), scaled down: every output token is counted, the decode
    rate is that of the timed steps once every prompt is prefilled, and a turn's timed prompts
    find their history in the prefix cache."""
    out = tmp_path / "long.json"
    command = [sys.executable, str(RUN_WORKLOADS), "--model", tiny_model, *ENGINE_FLAGS]
    command += ["--scale", "0.01", "--workloads", "long,decode8k,turn16,turn64", "--out", str(out)]
    command += ["--repeats", "3"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    long, decode = (json.loads(out.read_text())["workloads"][n] for n in ("long", "decode8k"))
    assert (long["num_prompts"], long["input_len"]) == (1, 40)
    assert long["num_output_tokens"] == 1 and long["output_tokens_per_second"] > 0
    # `--repeats 3`: repeat 0 keeps the workload's figures; the median is the middle rate.
    rates = long["repeats_output_tokens_per_second"]
    assert len(rates) == 3 and rates[0] == long["output_tokens_per_second"]
    assert long["median_output_tokens_per_second"] == sorted(rates)[1]
    assert "repeats_output_tokens_per_second" not in decode
    assert (decode["num_prompts"], decode["context_len"], decode["decode_steps"]) == (1, 80, 1)
    assert decode["decode_tokens_per_second"] == pytest.approx(1e3 / decode["decode_step_ms"])
    report = json.loads(out.read_text())["workloads"]
    for name, (cached, new) in {"turn16": (60, 15), "turn64": (30, 3)}.items():
        turn = report[name]
        assert (turn["num_prompts"], turn["cached_len"], turn["new_len"]) == (1, cached, new)
        assert turn["num_prompt_tokens"] == cached + new and turn["num_output_tokens"] == 1
        # Whole 16-token blocks of the history come from the cache.
        assert turn["num_cached_prompt_tokens"] == cached // 16 * 16


def test_run_workloads_rejects_unknown_workload(tiny_model: str, tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("run_workloads", RUN_WORKLOADS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--model", tiny_model, "--workloads", "lat,c32", "--out", str(tmp_path / "x.json")]
    assert module.main(argv) == 2
    argv = ["--model", tiny_model, "--repeats", "0", "--out", str(tmp_path / "x.json")]
    assert module.main(argv) == 2
    assert not (tmp_path / "x.json").exists()


def test_workloads_mirror_the_shared_recipes() -> None:
    # Values of ../shared/bench/workloads.py: a drift in the copy changes every figure.
    assert workloads.lat_prompt()[:6] == [6311, 6890, 663, 4242, 8376, 7961]
    assert workloads.lat_prompt(seed=3, n_in=4) == [3898, 9709, 8916, 2136]
    prompts, outs = workloads.batch(3, n_in=5, n_out=7, seed=2)
    assert prompts[2] == [585, 9522, 2594, 7056, 6447] and outs == [7, 7, 7]
    prompts, outs = workloads.nano()
    assert [len(p) for p in prompts[:4]] == [964, 724, 484, 508] and outs[:4] == [
        845,
        312,
        607,
        843,
    ]
    assert (sum(outs), sum(len(p) for p in prompts)) == (133966, 142827)
    assert prompts[-1][:3] == [7495, 7736, 6563]


def test_fold_to_vocab() -> None:
    prompts = [[0, 4095, 4096, 10000]]
    assert workloads.fold_to_vocab(prompts, 4096) == [[0, 4095, 0, 1808]]
    assert workloads.fold_to_vocab(prompts, 151936) is prompts


@pytest.mark.parametrize(
    "name", ["qwen3-0.6b", "qwen3-8b", "qwen3-8b-fp8", "qwen3-30b-a3b", "gemma3-12b"]
)
def test_benchmark_model_configs_load(name: str) -> None:
    config = ModelConfig(str(REPO_ROOT / "benchmarks" / "models" / name))
    assert config.architecture.startswith(("Qwen3", "Gemma3")) and config.vocab_size > 10000
    assert config.dtype == "bfloat16"
    assert (config.quant_config is not None) == name.endswith("-fp8")


def test_run_workloads_prefix_hits_a_hybrid_models_state_snapshot(
    tiny_checkpoint, tmp_path: Path
) -> None:
    out = tmp_path / "prefix.json"
    command = [
        sys.executable,
        str(RUN_WORKLOADS),
        "--model",
        tiny_checkpoint("qwen3_5"),
        *ENGINE_FLAGS,
        "--block-size",
        "4",
        "--recurrent-snapshot-interval",
        "8",
        "--workloads",
        "prefix",
        "--scale",
        "0.01",
        "--lat-iters",
        "2",
        "--lat-warmup",
        "1",
        "--out",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    prefix = json.loads(out.read_text())["workloads"]["prefix"]
    # A 20-token prefix + 1: the cold run keeps a snapshot after 16 tokens, which each hit uses.
    assert (prefix["prefix_len"], prefix["suffix_len"]) == (20, 1)
    assert prefix["num_cached_tokens"] == [16, 16]
    assert prefix["cold_ttft_ms"] > 0 and prefix["hit_ttft_ms"] > 0
