"""`ferrum tune` on the CPU, its timer injected: the shapes it plans, the tables it writes (read
back by the kernels' lookup from the user folder), and resuming an interrupted run."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from ferrum.bench import tune, tune_args
from ferrum.bench.tune_ops import candidates
from ferrum.bench.tune_shapes import LinearShape, MoEShape, TuneTask, build_tasks
from ferrum.bench.tune_store import LOG_NAME, TuneStore
from ferrum.default_model import DEFAULT_MODEL_DIR
from ferrum.kernels import fp8_gemm_config, fused_moe_config, gemv_config, gemv_rows_config
from ferrum.kernels.device_properties import H100, L40S
from ferrum.kernels.fp8_gemm_config import Fp8GemmConfig, parse_buckets
from ferrum.kernels.fp8_gemm_rule import fp8_gemm_buckets, fp8_gemm_rule
from ferrum.kernels.fused_moe_config import GROUPED_KEYS, SMALL_KEYS, parse_section
from ferrum.kernels.fused_moe_config import parse_buckets as parse_moe_buckets
from ferrum.kernels.fused_moe_rule import (
    W8A8_MIN_TOKENS,
    moe_configs,
    small_rule,
    w8a8_configs,
    w8a8_rule,
)
from ferrum.kernels.gemv_config import gemv_tile
from ferrum.kernels.gemv_rows import GemvRowsTile
from ferrum.kernels.gemv_rows_config import gemv_rows_tile
from ferrum.kernels.tuned_tables import set_user_config_dir, user_config_dir


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    tune_args.add_cli_args(parser)
    return parser.parse_args(argv)


@pytest.fixture
def read_from():
    """Points the kernels' lookup at a folder (restored after), table caches emptied."""
    before = user_config_dir()

    def point(folder: Path | None) -> None:
        set_user_config_dir(folder)
        fp8_gemm_config.load_tuned_buckets.cache_clear()
        fused_moe_config.load_tuned.cache_clear()
        gemv_config.get_gemv_tiles.cache_clear()
        gemv_rows_config.get_gemv_rows_tiles.cache_clear()

    yield point
    point(before)


def _score(task: TuneTask, config) -> float:
    """A fake timer: a config's microseconds from its fields, so the best is known."""
    if config is None:
        return 5.0
    fields = config if isinstance(config, dict) else dataclasses.asdict(config)
    return float(sum(v for v in fields.values() if isinstance(v, int)))


def _best(task: TuneTask, device=L40S):
    return min(candidates(task, device), key=lambda c: _score(task, c))


def test_plan_reads_the_model_shapes_under_tensor_parallelism() -> None:
    plan = tune.plan_from_args(_args(str(DEFAULT_MODEL_DIR), "-tp", "2", "--batch-sizes", "4,1"))
    full = tune.plan_from_args(_args(str(DEFAULT_MODEL_DIR)))
    assert plan.ops == ("gemv", "gemv_rows", "moe_grouped", "moe_small")
    assert plan.batch_sizes == (1, 4)
    assert {s.n for s in plan.linear} <= {s.n for s in full.linear} | {
        s.n // 2 for s in full.linear
    }
    assert full.linear[-1].n > full.linear[-1].k  # the LM head (bf16 only)
    fp8 = tune.plan_from_args(_args(str(DEFAULT_MODEL_DIR), "--dtype", "fp8"))
    assert fp8.linear == full.linear[:-1]
    assert fp8.ops == ("fp8_gemm", "moe_grouped", "moe_small", "moe_w8a8")
    # FP8 tensor cores: W8A8 runs the grouped batches, so the weight-only grouped GEMMs are
    # not tuned unless asked for.
    hopper = tune.plan_from_args(_args(str(DEFAULT_MODEL_DIR), "--dtype", "fp8"), True)
    assert hopper.ops == ("fp8_gemm", "moe_small", "moe_w8a8")
    asked = _args(str(DEFAULT_MODEL_DIR), "--dtype", "fp8", "--ops", "moe_grouped")
    assert tune.plan_from_args(asked, True).ops == ("moe_grouped",)
    assert tune.plan_from_args(_args(str(DEFAULT_MODEL_DIR)), True).ops == plan.ops


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--shape", "linear:4096"], "--shape"),
        (["--shape", "linear:8:8", "--ops", "fp8_gemm"], "--dtype fp8"),
        ([], "model folder or --shape"),
        (["--shape", "moe:8:16:32:2", "--batch-sizes", "0,4"], "--batch-sizes"),
        (["--shape", "linear:8:8", "--ops", "gemm"], "unknown op"),
    ],
)
def test_plan_names_the_bad_flag(argv, match) -> None:
    with pytest.raises(ValueError, match=match):
        tune.plan_from_args(_args(*argv)).tasks()


def test_moe_batches_split_between_the_two_paths() -> None:
    moe = MoEShape(8, 16, 32, 2)
    tasks = build_tasks(("moe_small", "moe_grouped"), [], [moe], (1, 8, 9, 64))
    assert [(t.op, t.m) for t in tasks] == [
        ("moe_small", 1), ("moe_small", 8), ("moe_grouped", 9), ("moe_grouped", 64)
    ]  # fmt: skip


def test_search_spaces_hold_only_configs_the_kernels_take() -> None:
    shape = LinearShape(4096, 4096)
    hopper = candidates(TuneTask("fp8_gemm", shape, 64), H100)
    assert {c.backend for c in hopper} == {"triton", "wgmma", "scaled_mm"}
    ada = candidates(TuneTask("fp8_gemm", shape, 64), L40S)
    assert {c.backend for c in ada} == {"triton"}  # block scales: cuBLASLt's needs sm90
    assert {c.backend for c in candidates(TuneTask("fp8_gemm", shape, 1), L40S)} == {"gemv"}
    assert candidates(TuneTask("fp8_gemm", LinearShape(64, 100), 4), H100) == []
    moe = MoEShape(128, 768, 2048, 8)
    for op, keys in (("moe_grouped", GROUPED_KEYS), ("moe_small", SMALL_KEYS)):
        found = candidates(TuneTask(op, moe, 16 if op == "moe_grouped" else 2), H100)
        parse_moe_buckets({str(i + 1): c for i, c in enumerate(found)}, keys, op)
    found = candidates(TuneTask("moe_w8a8", moe, 64), H100)
    parse_section("grouped_w8a8", {str(i + 1): c for i, c in enumerate(found)}, "moe_w8a8")
    assert candidates(TuneTask("gemv", shape, 1), H100)[0] is None  # F.linear


def test_tuned_tables_round_trip_into_the_kernels_lookup(tmp_path, read_from) -> None:
    linear, moe = LinearShape(256, 512), MoEShape(8, 128, 256, 2)
    tasks = build_tasks(("fp8_gemm", "moe_grouped", "moe_small"), [linear], [moe], (1, 2, 16))
    store = TuneStore(tmp_path, L40S, fp8=True)
    counts = tune.run_tuning(tasks, store, lambda t: candidates(t, L40S), _score, False)
    assert counts == {"measured": 6, "skipped": 0, "empty": 0, "failed": 0}
    read_from(tmp_path)
    moe_args = (8, 128, 256, 2, L40S, True)
    buckets = fp8_gemm_buckets("block", 256, 512, L40S)
    for m in (1, 2, 16):
        assert buckets[m] == _best(TuneTask("fp8_gemm", linear, m))
    rule = fp8_gemm_rule("block", 256, 512, L40S)
    assert buckets[1 << 62] == rule[1 << 62]  # the rule above the largest measured batch
    assert moe_configs(16, *moe_args)[0] == _best(TuneTask("moe_grouped", moe, 16))
    assert moe_configs(2, *moe_args)[1] == _best(TuneTask("moe_small", moe, 2))
    assert moe_configs(4, *moe_args)[1] == small_rule(4, *moe_args)  # unmeasured: the rule's
    name = f"E8_I128_H256_fp8_{L40S.table_name}.json"
    assert (tmp_path / "fused_moe_configs" / name).is_file()
    path = tmp_path / "fp8_gemm_configs" / f"block_N256_K512_{L40S.table_name}.json"
    assert parse_buckets(json.loads(path.read_text()), str(path)) == buckets


def test_w8a8_tables_round_trip_into_the_kernels_lookup(tmp_path, read_from) -> None:
    """moe_w8a8 runs at the batches the rule gives W8A8, only with FP8 experts; its results are
    the `grouped_w8a8` section of the FP8 experts' file, the rule's buckets elsewhere."""
    moe = MoEShape(8, 128, 256, 2)
    tasks = build_tasks(("moe_w8a8",), [], [moe], (1, 8, 9, 64))
    assert [t.m for t in tasks] == [m for m in (9, 64) if m >= W8A8_MIN_TOKENS]
    with pytest.raises(ValueError, match="use --dtype fp8"):
        tune.plan_from_args(_args("--shape", "moe:8:128:256:2", "--ops", "moe_w8a8"))
    store = TuneStore(tmp_path, H100, fp8=True)
    tune.run_tuning(tasks, store, lambda t: candidates(t, H100), _score, False)
    read_from(tmp_path)
    for m in (9, 64):
        assert w8a8_configs(m, 8, 128, 256, 2, H100) == _best(TuneTask("moe_w8a8", moe, m), H100)
    assert w8a8_configs(4096, 8, 128, 256, 2, H100) == w8a8_rule(4096, 8, 128, 256, 2, H100)
    path = tmp_path / "fused_moe_configs" / f"E8_I128_H256_fp8_{H100.table_name}.json"
    assert set(json.loads(path.read_text())) == {"grouped_w8a8"}


def test_gemv_results_mark_f_linear_winners_null(tmp_path, read_from) -> None:
    shapes = [LinearShape(256, 512), LinearShape(64, 1024)]
    store = TuneStore(tmp_path, H100, fp8=False)

    def time_fn(task: TuneTask, config) -> float:
        faster_linear = task.shape.n == 64
        return (1.0 if faster_linear else 9.0) if config is None else 2.0 + config.BLOCK_N / 64

    tasks = build_tasks(("gemv",), shapes, [], (1,))
    tune.run_tuning(tasks, store, lambda t: candidates(t, H100), time_fn, False)
    read_from(tmp_path)
    assert gemv_tile(64, 1024, H100) is None
    first_narrowest = candidates(TuneTask("gemv", shapes[0], 1), H100)[1]  # [0]: F.linear
    assert gemv_tile(256, 512, H100) == first_narrowest


def test_gemv_rows_results_land_in_their_row_buckets(tmp_path, read_from) -> None:
    """gemv_rows runs at the batch sizes that are row buckets; each result is its bucket's
    entry (null where F.linear won), which the engine's lookup then reads for the rows the
    bucket holds."""
    shape = LinearShape(256, 4096)
    tasks = build_tasks(("gemv_rows",), [shape], [], (1, 2, 3, 4, 16, 32))
    assert [t.m for t in tasks] == [2, 4, 16]
    found = candidates(tasks[0], H100)
    assert found[0] is None and all(isinstance(c, GemvRowsTile) for c in found[1:])
    assert all(c.SPLIT_K == 1 or 4096 // c.BLOCK_K >= 2 * c.SPLIT_K for c in found[1:])

    def time_fn(task: TuneTask, config) -> float:  # F.linear wins at 16 rows only
        if config is None:
            return 1.0 if task.m == 16 else 9.0
        return 2.0 + config.BLOCK_N / 64 + config.SPLIT_K / 16

    tune.run_tuning(tasks, TuneStore(tmp_path, H100, fp8=False), lambda t: found, time_fn, False)
    read_from(tmp_path)
    first = min(found[1:], key=lambda c: time_fn(tasks[0], c))  # the first of the fastest
    assert first.BLOCK_N == 16 and first.SPLIT_K == 1
    assert gemv_rows_tile(256, 4096, 2, H100) == first
    assert gemv_rows_tile(256, 4096, 3, H100) == first  # 3 rows: bucket 4
    assert gemv_rows_tile(256, 4096, 9, H100) is None  # bucket 16: F.linear won
    assert (tmp_path / "gemv_rows_configs" / f"{H100.table_name}.json").is_file()


def test_a_rerun_resumes_where_an_interrupted_run_stopped(tmp_path) -> None:
    shape = LinearShape(256, 512)
    tasks = build_tasks(("fp8_gemm",), [shape], [], (1, 2, 4, 8))
    timed: list[str] = []

    def interrupted(task: TuneTask, config: Fp8GemmConfig) -> float:
        if task.m == 4:
            raise KeyboardInterrupt
        timed.append(task.key)
        return _score(task, config)

    def get(task: TuneTask) -> list:
        return candidates(task, L40S)[:3]

    with pytest.raises(KeyboardInterrupt):
        tune.run_tuning(tasks, TuneStore(tmp_path, L40S, fp8=True), get, interrupted, False)
    assert sorted(set(timed)) == [tasks[0].key, tasks[1].key]
    with (tmp_path / LOG_NAME).open("a") as log:
        log.write('{"device": "NVIDIA L40S", "task": ')  # a line torn by the interruption
    timed.clear()
    store = TuneStore(tmp_path, L40S, fp8=True)
    counts = tune.run_tuning(tasks, store, get, lambda t, c: timed.append(t.key) or 1.0, False)
    assert counts["measured"] == 2 and counts["skipped"] == 2
    assert sorted(set(timed)) == [tasks[2].key, tasks[3].key]
    other_gpu = TuneStore(tmp_path, H100, fp8=True)
    assert not any(other_gpu.measured(t) for t in tasks)  # results are per device


def test_failing_candidates_are_counted_and_an_op_without_any_is_not_recorded(tmp_path) -> None:
    tasks = build_tasks(("fp8_gemm",), [LinearShape(256, 512)], [], (2,))
    store = TuneStore(tmp_path, L40S, fp8=True)

    def refuse(task: TuneTask, config: Fp8GemmConfig) -> float:
        raise RuntimeError("out of resources")

    counts = tune.run_tuning(tasks, store, lambda t: candidates(t, L40S)[:2], refuse, False)
    assert counts == {"measured": 0, "skipped": 0, "empty": 1, "failed": 2}
    assert not store.measured(tasks[0]) and not (tmp_path / LOG_NAME).exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_the_command_refuses_without_cuda(capsys) -> None:
    from ferrum.entrypoints.cli import main

    assert main(["tune", "--shape", "linear:256:512"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


def test_the_tune_command_is_defined_without_importing_torch() -> None:
    """Every `ferrum` command builds the parser `tune` is on, the API server's among them: its
    flags import neither torch nor triton (the run imports them when it runs)."""
    import subprocess
    import sys

    code = (
        "import argparse, sys; from ferrum.bench import tune_args; "
        "tune_args.add_cli_args(argparse.ArgumentParser()); "
        "print('torch' in sys.modules, 'triton' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
