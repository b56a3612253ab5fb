"""Where `ferrum tune` keeps its results, so that a run can stop at any point and a rerun goes on:
every measured (op, shape, batch) is one line appended to `<folder>/tune_log.jsonl` (device,
variant, config, microseconds), then the table file it belongs to is rewritten (atomically) in
the format the kernels read (tuned_tables): the tuned buckets over what the kernels would have
read without this folder's file (the packaged table, else the rule). A rerun skips the tasks the
log already holds for this device and variant, and rebuilds every table from the log first."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ferrum.bench.tune_shapes import LinearShape, MoEShape, TuneTask
from ferrum.kernels.device_properties import DeviceProperties
from ferrum.kernels.fp8_gemm_config import CONFIG_DIR as FP8_GEMM_DIR
from ferrum.kernels.fp8_gemm_config import Fp8GemmConfig, load_tuned_buckets, save_buckets
from ferrum.kernels.fp8_gemm_rule import fp8_gemm_rule
from ferrum.kernels.fused_moe_config import CONFIG_DIR as FUSED_MOE_DIR
from ferrum.kernels.fused_moe_config import load_tuned, save_section
from ferrum.kernels.fused_moe_rule import rule_buckets
from ferrum.kernels.gemv_config import CONFIG_DIR as GEMV_DIR
from ferrum.kernels.gemv_config import GemvTile, save_gemv_tiles
from ferrum.kernels.gemv_rows import GemvRowsTile
from ferrum.kernels.gemv_rows_config import CONFIG_DIR as GEMV_ROWS_DIR
from ferrum.kernels.gemv_rows_config import save_gemv_rows_tiles

LOG_NAME = "tune_log.jsonl"
# A measured config: an Fp8GemmConfig, a GemvTile or GemvRowsTile (None: F.linear won), or a MoE
# config dict.
Config = Fp8GemmConfig | GemvTile | GemvRowsTile | dict[str, int] | None


def config_to_json(config: Config) -> dict[str, Any] | None:
    if config is None or isinstance(config, dict):
        return config
    return dataclasses.asdict(config)


def config_from_json(op: str, data: dict[str, Any] | None) -> Config:
    if data is None or op.startswith("moe"):
        return data
    if op == "gemv_rows":
        return GemvRowsTile(**data)
    return Fp8GemmConfig(**data) if op == "fp8_gemm" else GemvTile(**data)


class TuneStore:
    """The log and tables of one device and variant ("bf16", or "fp8" with its scale format)
    in `folder`. `measured` says whether a task is done; `record` adds one."""

    def __init__(
        self, folder: Path, device: DeviceProperties, fp8: bool, scale_format: str = "block"
    ) -> None:
        self.folder = folder
        self.device = device
        self.fp8 = fp8
        self.scale_format = scale_format
        self.log_path = folder / LOG_NAME
        self._done: dict[str, dict[str, Any]] = {}
        for entry in self._entries():
            self._done[entry["task"]] = entry

    def _variant(self, op: str) -> str:
        if op == "fp8_gemm":
            return f"fp8_{self.scale_format}"
        return "fp8" if self.fp8 and op.startswith("moe") else "bf16"

    def _entries(self) -> Iterator[dict[str, Any]]:
        """This device's log lines of this store's variants (a torn last line is skipped)."""
        if not self.log_path.is_file():
            return
        for line in self.log_path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if entry.get("device") == self.device.name and entry.get("variant") == self._variant(
                entry.get("op", "")
            ):
                yield entry

    def measured(self, task: TuneTask) -> bool:
        return task.key in self._done

    def record(self, task: TuneTask, config: Config, us: float, num_candidates: int) -> Path:
        """Appends the task's result to the log, then rewrites its table; returns the table."""
        entry = {
            "device": self.device.name,
            "variant": self._variant(task.op),
            "task": task.key,
            "op": task.op,
            "shape": dataclasses.asdict(task.shape),
            "m": task.m,
            "config": config_to_json(config),
            "us": us,
            "candidates": num_candidates,
        }
        self.folder.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as log:
            log.write(json.dumps(entry) + "\n")
        self._done[task.key] = entry
        return self.write_table(task.op, task.shape)

    def _results(self, op: str, shape: LinearShape | MoEShape) -> dict[int, Config]:
        key = dataclasses.asdict(shape)
        return {
            e["m"]: config_from_json(op, e["config"])
            for e in self._done.values()
            if e["op"] == op and e["shape"] == key
        }

    def write_all(self) -> list[Path]:
        """Rewrites every table the log holds results for (after an interrupted write)."""
        shapes = {(e["op"], json.dumps(e["shape"], sort_keys=True)) for e in self._done.values()}
        paths = []
        for op, text in sorted(shapes):
            fields = json.loads(text)
            shape = MoEShape(**fields) if "top_k" in fields else LinearShape(**fields)
            paths.append(self.write_table(op, shape))
        return paths

    def write_table(self, op: str, shape: LinearShape | MoEShape) -> Path:
        results = self._results(op, shape)
        name = self.device.name
        if op == "gemv":
            assert isinstance(shape, LinearShape)
            tiles = {(shape.n, shape.k): results[1]} if 1 in results else {}
            return save_gemv_tiles(name, tiles, self.folder / GEMV_DIR.name)  # type: ignore[arg-type]
        if op == "gemv_rows":
            assert isinstance(shape, LinearShape)
            rows = {(shape.n, shape.k, m): tile for m, tile in results.items()}
            return save_gemv_rows_tiles(name, rows, self.folder / GEMV_ROWS_DIR.name)  # type: ignore[arg-type]
        if op == "fp8_gemm":
            assert isinstance(shape, LinearShape)
            fmt, n, k = self.scale_format, shape.n, shape.k
            load_tuned_buckets.cache_clear()
            base = load_tuned_buckets(fmt, n, k, name, self.folder) or fp8_gemm_rule(
                fmt, n, k, self.device
            )
            buckets = dict(sorted((base | results).items()))  # type: ignore[operator]
            return save_buckets(fmt, n, k, name, buckets, self.folder / FP8_GEMM_DIR.name)
        assert isinstance(shape, MoEShape)
        section = {"moe_small": "small", "moe_w8a8": "grouped_w8a8"}.get(op, "grouped")
        e, i, h = shape.num_experts, shape.inter, shape.hidden
        load_tuned.cache_clear()
        sections = load_tuned(e, i, h, name, False, self.folder)
        if self.fp8:
            sections = sections | load_tuned(e, i, h, name, True, self.folder)
        base = sections.get(section) or rule_buckets(
            section, e, i, h, shape.top_k, self.device, self.fp8
        )
        buckets = base | results  # type: ignore[operator]
        folder = self.folder / FUSED_MOE_DIR.name
        return save_section(e, i, h, name, section, buckets, folder, fp8=self.fp8)  # type: ignore[arg-type]
