"""`ferrum bench serve` against a server with speculative decoding: its report's speculative
section comes from the server's spec_decode counters over the run; the counters' parsing and
differences on a fixed /metrics text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ferrum.bench.serve_spec_metrics import (
    format_spec_decode,
    parse_spec_counters,
    spec_decode_summary,
)
from ferrum.default_model import DEFAULT_MODEL_NAME
from ferrum.entrypoints.cli import main as cli_main
from tests.utils.remote_server import RemoteServer

METRICS = """# HELP ferrum:spec_decode_num_drafts_total Drafts verified
ferrum:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
ferrum:spec_decode_num_drafts_total{engine="1",model_name="m"} 2.0
ferrum:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
ferrum:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 14.0
ferrum:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 8.0
ferrum:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 6.0
ferrum:prefix_cache_hits_total{engine="0",model_name="m"} 99.0
"""


def test_counters_sum_engines_and_the_run_is_their_difference() -> None:
    after = parse_spec_counters(METRICS)
    assert after == {
        "num_drafts": 12.0,
        "num_draft_tokens": 30.0,
        "num_accepted_tokens": 14.0,
        "per_position": [8.0, 6.0],
    }
    before = {"num_drafts": 2.0, "num_draft_tokens": 6.0, "num_accepted_tokens": 4.0}
    summary = spec_decode_summary(before | {"per_position": [3.0]}, after)
    assert summary == {
        "num_drafts": 10,
        "draft_tokens": 24,
        "accepted_tokens": 10,
        "acceptance_rate": pytest.approx(10 / 24),
        "acceptance_length": 2.0,
        "per_position_acceptance_rate": [0.5, 0.6],
    }
    assert any(
        "Acceptance length:" in line and "2.00" in line for line in format_spec_decode(summary)
    )
    assert spec_decode_summary(after, after) is None  # no draft verified in the run


def test_a_speculating_server_reports_its_acceptance(tmp_path: Path) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None}
    server = RemoteServer(
        ["--max-model-len", "512", "--speculative-config", json.dumps(spec)], tmp_path / "s.log"
    )
    try:
        result_path = tmp_path / "result.json"
        code = cli_main(
            [
                "bench", "serve", "--base-url", server.url, "--model", DEFAULT_MODEL_NAME,
                "--disable-tqdm", "--result-filename", str(result_path),
                "--num-prompts", "6", "--random-input-len", "24", "--random-output-len", "48",
            ]
        )  # fmt: skip
        assert code == 0
        result = json.loads(result_path.read_text())
        assert result["completed"] == 6
        spec_decode = result["spec_decode"]
        assert spec_decode["num_drafts"] > 0 and spec_decode["accepted_tokens"] > 0
        assert 1.0 < spec_decode["acceptance_length"] <= 4.0
    finally:
        assert server.stop() == 0, server.log()
