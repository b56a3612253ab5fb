"""A forward that raises in the core: in-flight requests get errors, /health turns 503."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from ferrum.default_model import DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME
from tests.utils.remote_server import REPO_ROOT, RemoteServer, free_port

MODEL = DEFAULT_MODEL_NAME
# Late enough that every request of the test is running when it fails (each asks for 400
# tokens, so none has finished).
FAIL_AT_FORWARD = 150


@pytest.fixture(scope="module")
def faulty_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    log = tmp_path_factory.mktemp("fault") / "server.log"
    # Async scheduling: the fault hits a launch while the step before it is still in flight.
    remote = RemoteServer(
        ["--max-model-len", "512", "--async-scheduling"],
        log,
        env={"FERRUM_DEBUG_FAIL_FORWARD": str(FAIL_AT_FORWARD)},
    )
    yield remote
    assert remote.stop() == 0, remote.log()


def _wait_for_running(server: RemoteServer, num_requests: int) -> None:
    deadline = time.monotonic() + 30
    while server.metrics()["ferrum:num_requests_running"] < num_requests:
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.02)


def _stream(server: RemoteServer) -> str:
    stream = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Talk"}],
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    try:
        for _ in stream:
            pass
    except openai.APIError as e:
        return str(e)
    return "finished without error"


def _complete(server: RemoteServer) -> str:
    try:
        server.client().completions.create(
            model=MODEL, prompt="Talk", max_tokens=400, extra_body={"ignore_eos": True}
        )
    except openai.APIStatusError as e:
        return f"{e.status_code}: {e.body}"
    return "finished without error"


def test_forward_fault_fails_in_flight_requests(faulty_server: RemoteServer) -> None:
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_stream, faulty_server) for _ in range(3)]
        futures.append(pool.submit(_complete, faulty_server))
        _wait_for_running(faulty_server, 4)
        results = [f.result(timeout=60) for f in futures]
    for result in results[:3]:
        assert "engine is dead" in result and "injected fault" in result
    assert results[3].startswith("503") and "engine_dead" in results[3]
    health = httpx.get(faulty_server.url + "/health", timeout=10)
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    later = httpx.post(faulty_server.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert later.status_code == 503 and later.json()["error"]["code"] == "engine_dead"
    log = faulty_server.log()
    assert f"RuntimeError: injected fault in forward {FAIL_AT_FORWARD}" in log
    assert "failing 4 in-flight request(s)" in log


def _core_pid(server: RemoteServer) -> int:
    pid = server.process.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for child in children:
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"multiprocessing.spawn" in cmdline and b"resource_tracker" not in cmdline:
            return int(child)
    raise AssertionError(f"no engine core process among {children}")


def test_killed_core_fails_in_flight_requests(tmp_path: Path) -> None:
    server = RemoteServer(["--max-model-len", "512"], tmp_path / "server.log")
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(_stream, server), pool.submit(_complete, server)]
            _wait_for_running(server, 2)
            os.kill(_core_pid(server), signal.SIGKILL)
            stream_result, complete_result = (f.result(timeout=60) for f in futures)
        assert "engine is dead" in stream_result and "exited unexpectedly" in stream_result
        assert complete_result.startswith("503")
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503
        assert server.stop() == 0, server.log()
    finally:
        server.stop(signal.SIGKILL)


def test_engine_that_fails_to_load_exits_nonzero(tmp_path: Path) -> None:
    # A model folder without weights: config and tokenizer load, the core process fails.
    model = tmp_path / "no-weights"
    model.mkdir()
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        shutil.copy(Path(DEFAULT_MODEL_DIR) / name, model / name)
    port = str(free_port())
    result = subprocess.run(
        [sys.executable, "-m", "ferrum", "serve", str(model), "--port", port, "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "the engine failed to start" in result.stderr
