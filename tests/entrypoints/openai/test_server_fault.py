"""Engine-core failures under live streams: with the default policy a fresh core resumes every
stream (a raising forward, a killed core, a stopped core), a poison request is failed alone, and
a crash loop ends the server; with --engine-failure-policy exit the server exits non-zero."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ferrum import LLM
from ferrum.default_model import DEFAULT_MODEL_DIR
from tests.utils.processes import is_running
from tests.utils.remote_server import REPO_ROOT, RemoteServer, free_port
from tests.utils.streams import (
    assert_intact,
    expected_stream_texts,
    full_log,
    prompt_of,
    stream_all,
)

NUM_STREAMS = 32
# The first core's 12th forward raises: the streams have started by then and none has finished.
FAIL_AT_FORWARD = 12
# A prompt holding this token id crashes every forward it is in (no text prompt tokenizes to it).
POISON_TOKEN_ID = 8191
# Room for all 32 streams without preemption.
SERVER_ARGS = ["--max-model-len", "512", "--async-scheduling", "--num-kv-blocks", "256"]


@pytest.fixture(scope="module")
def expected_texts(shipped_llm: LLM) -> list[str]:
    """The uninterrupted greedy outputs of the streams' prompts."""
    return expected_stream_texts(shipped_llm, NUM_STREAMS)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    """Restart policy; the first core's FAIL_AT_FORWARD-th forward raises, poison prompts raise
    in every core, a core that makes no progress for 3 s with work counts as stuck (a slow step
    on a loaded machine still spends CPU time: progress)."""
    log = tmp_path_factory.mktemp("fault") / "server.log"
    remote = RemoteServer(
        [*SERVER_ARGS, "--engine-stall-timeout", "3", "--engine-max-restarts", "20"],
        log,
        env={
            "FERRUM_DEBUG_FAIL_FORWARD": str(FAIL_AT_FORWARD),
            "FERRUM_DEBUG_FAIL_ON_TOKEN": str(POISON_TOKEN_ID),
        },
    )
    yield remote
    assert remote.stop() == 0, remote.log()


def core_pid(server: RemoteServer) -> int:
    """The server's engine core process (a spawned multiprocessing child)."""
    pid = server.process.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for child in children:
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        spawned = b"multiprocessing.spawn" in cmdline and b"resource_tracker" not in cmdline
        if spawned and is_running(int(child)):
            return int(child)
    raise AssertionError(f"no engine core process among {children}")


def test_forward_fault_streams_continue(server: RemoteServer, expected_texts: list[str]) -> None:
    results = stream_all(server, [prompt_of(i) for i in range(NUM_STREAMS)])
    assert_intact(results, expected_texts)
    log = full_log(server)
    assert f"injected fault in forward {FAIL_AT_FORWARD}" in log
    assert "resuming" in log


def test_killed_core_streams_continue(server: RemoteServer, expected_texts: list[str]) -> None:
    pid = core_pid(server)
    prompts: list[str | list[int]] = [prompt_of(i) for i in range(NUM_STREAMS)]
    results = stream_all(server, prompts, lambda: os.kill(pid, signal.SIGKILL))
    assert_intact(results, expected_texts)
    assert "exited unexpectedly (exit code -9)" in full_log(server)


def test_stopped_core_is_restarted(server: RemoteServer, expected_texts: list[str]) -> None:
    pid = core_pid(server)
    prompts: list[str | list[int]] = [prompt_of(i) for i in range(NUM_STREAMS)]
    try:
        results = stream_all(server, prompts, lambda: os.kill(pid, signal.SIGSTOP))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # the server has killed it already unless this failed
    assert_intact(results, expected_texts)
    assert f"engine core (pid {pid}) finished no step and spent no CPU time" in full_log(server)


def test_health_tells_a_stopped_core_at_once(server: RemoteServer) -> None:
    pid = core_pid(server)
    os.kill(pid, signal.SIGSTOP)
    try:
        response = httpx.get(server.url + "/health", timeout=10)
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "engine_stopped"
    finally:
        os.kill(pid, signal.SIGCONT)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_poison_request_fails_alone(server: RemoteServer, expected_texts: list[str]) -> None:
    prompts: list[str | list[int]] = [prompt_of(i) for i in range(7)]
    prompts.insert(3, [1, 2, POISON_TOKEN_ID, 3])
    results = stream_all(server, prompts)
    poisoned = results.pop(3)
    assert poisoned.error is not None and poisoned.error["code"] == "request_crashed_engine"
    assert_intact(results, expected_texts[:7])
    assert "crashed the engine core twice" in full_log(server)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_a_slow_core_is_not_restarted(tmp_path: Path) -> None:
    # Every forward spins the CPU 1.5 s, past the 1 s stall timeout: the core's CPU time tells a
    # slow core from a stalled one, so it is never killed and the request finishes (one token:
    # its one forward already outlasts the timeout).
    server = RemoteServer(
        [*SERVER_ARGS, "--engine-stall-timeout", "1"],
        tmp_path / "server.log",
        env={"FERRUM_DEBUG_SLOW_FORWARD": "1.5"},
    )
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 1}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")
        assert "starting engine core #1" not in full_log(server)
    finally:
        assert server.stop() == 0, server.log()


def test_crash_loop_exits_nonzero(tmp_path: Path) -> None:
    # One poison request: it crashes the first core, then the restarted one when it runs alone;
    # with one restart allowed, the second crash ends the server.
    server = RemoteServer(
        [*SERVER_ARGS, "--engine-max-restarts", "1"],
        tmp_path / "server.log",
        env={"FERRUM_DEBUG_FAIL_ON_TOKEN": str(POISON_TOKEN_ID)},
    )
    try:
        (result,) = stream_all(server, [[1, 2, POISON_TOKEN_ID, 3]])
        assert result.error is not None and result.error["code"] == "engine_dead"
        assert server.process.wait(60) == 1, server.log()
        assert "giving up after 2 engine-core crashes" in full_log(server)
    finally:
        server.stop(signal.SIGKILL)


def test_exit_policy_exits_nonzero(tmp_path: Path) -> None:
    server = RemoteServer(
        [*SERVER_ARGS, "--engine-failure-policy", "exit"],
        tmp_path / "server.log",
        env={"FERRUM_DEBUG_FAIL_FORWARD": "3"},
    )
    try:
        results = stream_all(server, [prompt_of(i) for i in range(2)])
        for result in results:
            assert result.error is not None and result.error["code"] == "engine_dead"
            assert "injected fault" in result.error["message"]
        assert server.process.wait(60) == 1, server.log()
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
