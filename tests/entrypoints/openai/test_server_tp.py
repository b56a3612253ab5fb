"""`ferrum serve` with worker processes under the engine core, on the CPU (gloo): the
official client gets the greedy text of one process, constrained output works; a killed worker
restarts the core (the default policy) and every stream resumes intact; with the exit policy a
stopped (hung) worker fails the streams and the server exits; SIGTERM leaves no process."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest

from ferrum import LLM
from ferrum.default_model import DEFAULT_MODEL_NAME
from tests.utils.processes import descendant_pids, wait_gone, worker_pids
from tests.utils.remote_server import RemoteServer
from tests.utils.streams import (
    MAX_TOKENS,
    assert_intact,
    expected_stream_texts,
    full_log,
    prompt_of,
    stream_all,
)

NUM_STREAMS = 6
# Ranks of the tested servers, one worker process each.
WORLD_SIZE = 2
SERVER_ARGS = [
    *("-tp", str(WORLD_SIZE)),
    *("--max-model-len", "512", "--async-scheduling"),
]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}},
    "required": ["ok", "size"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    log = tmp_path_factory.mktemp("tp") / "server.log"
    args = [*SERVER_ARGS, "--structured-outputs-config", '{"disable_any_whitespace": true}']
    remote = RemoteServer(args, log)
    yield remote
    remote.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def expected_texts(shipped_llm: LLM) -> list[str]:
    """One process's greedy outputs of the streams' prompts."""
    return expected_stream_texts(shipped_llm, NUM_STREAMS)


def test_official_client_gets_the_text_of_one_process(
    server: RemoteServer, expected_texts: list[str]
) -> None:
    assert len(worker_pids(server.process.pid)) == WORLD_SIZE
    client = server.client()
    completion = client.completions.create(
        model=DEFAULT_MODEL_NAME, prompt=prompt_of(0), max_tokens=MAX_TOKENS, temperature=0
    )
    assert completion.choices[0].text == expected_texts[0]
    chat = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        messages=[{"role": "user", "content": "Describe the box."}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "box", "schema": SCHEMA}},
    )
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)


def test_killed_worker_restarts_the_core_and_streams_resume(
    server: RemoteServer, expected_texts: list[str]
) -> None:
    old_workers = worker_pids(server.process.pid)
    prompts: list[str | list[int]] = [prompt_of(i) for i in range(NUM_STREAMS)]
    rank = WORLD_SIZE - 1
    results = stream_all(server, prompts, lambda: os.kill(old_workers[rank], signal.SIGKILL))
    assert_intact(results, expected_texts)
    assert f"worker {rank} (pid {old_workers[rank]}) was killed by SIGKILL" in full_log(server)
    wait_gone(old_workers)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    new_workers = worker_pids(server.process.pid)
    assert len(new_workers) == WORLD_SIZE and not set(new_workers) & set(old_workers)


def test_sigterm_stops_every_process(server: RemoteServer) -> None:
    # Last of the module's tests on the shared server: it stops it.
    processes = descendant_pids(server.process.pid)
    assert len(worker_pids(server.process.pid)) == WORLD_SIZE
    assert server.stop(signal.SIGTERM) == 0, server.log()
    wait_gone(processes)


def test_hung_worker_with_exit_policy_fails_streams_and_exits(tmp_path: Path) -> None:
    server = RemoteServer(
        [*SERVER_ARGS, "--engine-failure-policy", "exit", "--engine-stall-timeout", "5"],
        tmp_path / "server.log",
    )
    try:
        processes = descendant_pids(server.process.pid)
        # Rank 0 answers each step: stopped, it stalls the core.
        stopped = worker_pids(server.process.pid)[0]
        results = stream_all(
            server, [prompt_of(i) for i in range(2)], lambda: os.kill(stopped, signal.SIGSTOP)
        )
        for result in results:
            assert result.error is not None and result.error["code"] == "engine_dead"
        assert server.process.wait(60) == 1, server.log()
        wait_gone(processes)
    finally:
        server.stop(signal.SIGKILL)
