"""`ferrum bench serve` / `ferrum bench compare` against a live `ferrum serve` on the shipped model
(loopback only), plus the client's failure handling against a misbehaving raw HTTP server."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

import ferrum.bench.serve as serve_module
from ferrum.bench.serve import run_benchmark
from ferrum.bench.serve_datasets import SampleRequest, random_dataset
from ferrum.bench.serve_metrics import RequestRecord, parse_goodput, summarize
from ferrum.default_model import DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME
from ferrum.engine.tokenizer import Tokenizer
from ferrum.entrypoints.cli import main as cli_main
from tests.utils.remote_server import API_KEY, RemoteServer, free_port

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    log = tmp_path_factory.mktemp("bench_server") / "server.log"
    remote = RemoteServer(["--max-model-len", "512"], log, api_key=API_KEY)
    yield remote
    assert remote.stop() == 0, remote.log()


def bench(server: RemoteServer, result: Path, *flags: str) -> tuple[int, dict]:
    code = cli_main(
        [
            "bench",
            "serve",
            "--base-url",
            server.url + "/v1",
            "--model",
            DEFAULT_MODEL_NAME,
            "--api-key",
            API_KEY,
            "--disable-tqdm",
            "--result-filename",
            str(result),
            *flags,
        ]
    )
    return code, json.loads(result.read_text())


def assert_ordered_positive(result: dict) -> None:
    for metric in ("ttft", "tpot", "itl", "e2el"):
        p50, p90, p99 = (result[f"{p}_{metric}_ms"] for p in ("p50", "p90", "p99"))
        assert result[f"mean_{metric}_ms"] > 0
        assert 0 < p50 <= p90 <= p99, metric
        assert result[f"median_{metric}_ms"] == p50
    assert result["median_ttft_ms"] < result["median_e2el_ms"]
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "duration"):
        assert result[key] > 0, key


def test_random_completions_counts_add_up(server: RemoteServer, tmp_path: Path) -> None:
    num_prompts, input_len, output_len = 12, 40, 12
    code, result = bench(
        server,
        tmp_path / "random.json",
        "--num-prompts", str(num_prompts),
        "--random-input-len", str(input_len),
        "--random-output-len", str(output_len),
        "--max-concurrency", "4",
        "--seed", "7",
        "--goodput", "ttft:60000", "e2el:60000",
    )  # fmt: skip
    assert code == 0
    assert result["completed"] == num_prompts and result["failed"] == 0
    assert result["errors"] == [""] * num_prompts
    expected = random_dataset(
        Tokenizer.from_pretrained(DEFAULT_MODEL_DIR), num_prompts, input_len, output_len, 0.0, 7
    )
    assert result["input_lens"] == [s.prompt_len for s in expected] == [input_len] * num_prompts
    assert result["total_input_tokens"] == num_prompts * input_len
    assert result["output_lens"] == [output_len] * num_prompts
    assert result["total_output_tokens"] == num_prompts * output_len
    # One gap per streamed chunk; a slow reader gets merged chunks, so at most one per token.
    assert all(1 <= len(itl) <= output_len - 1 for itl in result["itls"]), result["itls"]
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert_ordered_positive(result)


def test_chat_endpoint_with_range_ratio_and_poisson_rate(
    server: RemoteServer, tmp_path: Path
) -> None:
    code, result = bench(
        server,
        tmp_path / "chat.json",
        "--endpoint", "/v1/chat/completions",
        "--num-prompts", "6",
        "--random-input-len", "24",
        "--random-output-len", "10",
        "--random-range-ratio", "0.5",
        "--request-rate", "50",
    )  # fmt: skip
    assert code == 0
    assert result["completed"] == 6
    assert sum(result["input_lens"]) == result["total_input_tokens"] > 0
    assert all(5 <= n <= 15 for n in result["output_lens"])
    assert result["total_output_tokens"] == sum(result["output_lens"])
    assert result["request_rate"] == 50


def _prefix_hits(server: RemoteServer) -> float:
    metrics = server.metrics()
    return metrics.get("ferrum:prefix_cache_hits_total", metrics.get("ferrum:prefix_cache_hits"))


def test_prefix_dataset_hits_the_prefix_cache(server: RemoteServer, tmp_path: Path) -> None:
    num_prompts, num_groups, prefix_len = 8, 2, 4 * BLOCK_SIZE
    before = _prefix_hits(server)
    code, result = bench(
        server,
        tmp_path / "prefix.json",
        "--dataset-name", "prefix",
        "--num-prompts", str(num_prompts),
        "--num-prefix-groups", str(num_groups),
        "--prefix-len", str(prefix_len),
        "--random-input-len", "8",
        "--random-output-len", "4",
        "--max-concurrency", "1",
    )  # fmt: skip
    assert code == 0 and result["completed"] == num_prompts
    assert result["input_lens"] == [prefix_len + 8] * num_prompts
    # Every prompt after its group's first finds the whole prefix cached.
    assert _prefix_hits(server) - before >= (num_prompts - num_groups) * prefix_len


def test_killed_server_yields_failures_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = RemoteServer(["--max-model-len", "512"], tmp_path / "victim.log")
    num_prompts = 24
    real_send = serve_module.send_request
    successes = 0

    async def send_then_kill_after_two(*args: object, **kwargs: object) -> RequestRecord:
        # The kill happens in the client's loop once the client itself holds two complete
        # responses: at most one other request is in flight then, every later one is refused.
        nonlocal successes
        record = await real_send(*args, **kwargs)
        successes += record.success
        if record.success and successes == 2:
            victim.stop(signal.SIGKILL)
        return record

    monkeypatch.setattr(serve_module, "send_request", send_then_kill_after_two)
    try:
        code = cli_main(
            [
                "bench", "serve",
                "--port", str(victim.port),
                "--num-prompts", str(num_prompts),
                "--random-input-len", "16",
                "--random-output-len", "24",
                "--max-concurrency", "2",
                "--request-timeout", "30",
                "--disable-tqdm",
                "--result-filename", str(tmp_path / "killed.json"),
            ]
        )  # fmt: skip
    finally:
        victim.stop(signal.SIGKILL)
    result = json.loads((tmp_path / "killed.json").read_text())
    assert code == 0
    assert successes >= 2
    assert 2 <= result["completed"] <= 3 and result["failed"] >= num_prompts - 3
    assert result["completed"] + result["failed"] == num_prompts
    errors = [e for e in result["errors"] if e]
    assert len(errors) == result["failed"]
    assert any("Connect" in e for e in errors), errors
    assert result["total_output_tokens"] == 24 * result["completed"]


def test_every_request_failing_exits_nonzero(tmp_path: Path) -> None:
    code = cli_main(
        [
            "bench", "serve",
            "--port", str(free_port()),
            "--model", DEFAULT_MODEL_NAME,
            "--num-prompts", "3",
            "--random-input-len", "8",
            "--disable-tqdm",
            "--result-filename", str(tmp_path / "refused.json"),
        ]
    )  # fmt: skip
    result = json.loads((tmp_path / "refused.json").read_text())
    assert code == 1
    assert result["completed"] == 0 and result["failed"] == 3
    assert all("Connect" in e for e in result["errors"])


async def _serve_raw(response: bytes, samples: list[SampleRequest]) -> list[RequestRecord]:
    """Runs the client against a loopback server that answers every request with `response`."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(response)
        await writer.drain()
        writer.close()

    raw = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = raw.sockets[0].getsockname()[1]
    async with raw:
        records, _ = await run_benchmark(
            f"http://127.0.0.1:{port}/v1/completions", "m", samples, request_timeout=10
        )
    return records


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b'data: {"choices": [{"text": "a"}]}\n\n', "without data: [DONE]"),
        (b'data: {"error": {"message": "boom"}}\n\ndata: [DONE]\n\n', "boom"),
        (b"data: [DONE]\n\n", "no output"),
        (b"data: {not json\n\n", "JSONDecodeError"),
    ],
)
def test_broken_streams_are_failures(body: bytes, error: str) -> None:
    response = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n" + body
    )
    samples = [SampleRequest([1, 2], "x", 2, 4)] * 3
    records = asyncio.run(_serve_raw(response, samples))
    assert len(records) == 3
    assert all(not r.success and error in r.error for r in records), records
    summary = summarize(records, 1.0)
    assert summary["completed"] == 0 and summary["failed"] == 3
    assert summary["total_output_tokens"] == 0


def test_http_error_is_a_failure_with_its_body() -> None:
    body = b'{"error": "overloaded"}'
    response = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )
    records = asyncio.run(_serve_raw(response, [SampleRequest([1], "x", 1, 4)]))
    assert records[0].error == 'HTTP 503: {"error": "overloaded"}'


def test_goodput_parsing_rejects_bad_specs() -> None:
    assert parse_goodput(["ttft:500", "tpot:20.5"]) == {"ttft": 500.0, "tpot": 20.5}
    for bad in ("itl:5", "ttft", "ttft:abc", "ttft:-1", "e2el:0"):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput([bad])


def test_compare_round_trips_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fast = [RequestRecord(10, True, 5, 0.01, 0.05, [0.01] * 4) for _ in range(4)]
    slow = [RequestRecord(10, True, 5, 0.02, 0.10, [0.02] * 4) for _ in range(4)]
    slow.append(RequestRecord(10, error="HTTP 500: x"))
    for name, records in (("fast", fast), ("slow", slow)):
        (tmp_path / f"{name}.json").write_text(json.dumps(summarize(records, 1.0)))
    paths = [str(tmp_path / "fast.json"), str(tmp_path / "slow.json")]
    assert cli_main(["bench", "compare", *paths]) == 0
    table = capsys.readouterr().out
    assert "slow/fast" in table
    assert "mean TTFT ms" in table and "2.00x" in table
    failed = next(line for line in table.splitlines() if line.startswith("failed"))
    assert failed.split()[2:4] == ["0", "1"]
    assert cli_main(["bench", "compare", str(tmp_path / "missing.json")]) == 2


def test_compare_plot_writes_png(tmp_path: Path) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed")
    result = summarize([RequestRecord(10, True, 5, 0.01, 0.05, [0.01] * 4)], 1.0)
    (tmp_path / "a.json").write_text(json.dumps(result))
    png = tmp_path / "out.png"
    assert cli_main(["bench", "compare", str(tmp_path / "a.json"), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_served_model_name_falls_back_to_the_shipped_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli_main(
        [
            "bench", "serve",
            "--port", str(free_port()),
            "--served-model-name", "my-model",
            "--num-prompts", "1",
            "--random-input-len", "8",
            "--disable-tqdm",
            "--result-filename", str(tmp_path / "result.json"),
        ]
    )  # fmt: skip
    result = json.loads((tmp_path / "result.json").read_text())
    assert code == 1 and result["failed"] == 1  # nothing listens: only the set-up is tested
    assert (result["model_id"], result["tokenizer_id"]) == ("my-model", DEFAULT_MODEL_DIR)
    assert "prompts are built with the shipped model's tokenizer" in capsys.readouterr().err


def test_help_states_the_defaults() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    serve_module.add_cli_args(parser)
    text = " ".join(parser.format_help().split())
    assert "--temperature TEMPERATURE sampling temperature (default: 0.0)" in text
    assert "--seed SEED dataset and sampling seed (default: 0)" in text
    assert "--num-prompts NUM_PROMPTS requests to send (default: 1000)" in text
