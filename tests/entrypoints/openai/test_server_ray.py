"""`ferrum serve --distributed-executor-backend ray` on the CPU (gloo), the engine core starting a
local Ray instance of its own: the official client gets the greedy text of one process; a killed
worker actor restarts the core (the default policy) with fresh actors and every stream resumes
intact, the failed core's Ray instance gone; SIGTERM leaves no process behind."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import httpx
import pytest

from ferrum import LLM
from ferrum.default_model import DEFAULT_MODEL_NAME
from tests.utils.processes import descendant_pids, wait_gone, wait_until
from tests.utils.remote_server import RemoteServer
from tests.utils.streams import (
    MAX_TOKENS,
    assert_intact,
    expected_stream_texts,
    full_log,
    prompt_of,
    stream_all,
)

pytest.importorskip("ray")

NUM_STREAMS = 4
WORLD_SIZE = 2
SERVER_ARGS = [
    *("-tp", str(WORLD_SIZE), "--distributed-executor-backend", "ray"),
    *("--max-model-len", "512", "--async-scheduling"),
]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def actor_pids(server: RemoteServer) -> list[int]:
    """The server's Ray worker actors (below its core's Ray instance)."""
    return [
        p for p in descendant_pids(server.process.pid) if _cmdline(p).startswith(b"ray::RayWorker")
    ]


def core_tree(server: RemoteServer) -> list[int]:
    """The engine core process and everything below it (the Ray instance it started)."""
    children = [p for p in descendant_pids(server.process.pid) if b"spawn_main" in _cmdline(p)]
    assert len(children) == 1, children
    return [children[0], *descendant_pids(children[0])]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    remote = RemoteServer(SERVER_ARGS, tmp_path_factory.mktemp("ray") / "server.log")
    yield remote
    remote.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def expected_texts(shipped_llm: LLM) -> list[str]:
    return expected_stream_texts(shipped_llm, NUM_STREAMS)


def test_official_client_gets_the_text_of_one_process(
    server: RemoteServer, expected_texts: list[str]
) -> None:
    assert len(actor_pids(server)) == WORLD_SIZE
    completion = server.client().completions.create(
        model=DEFAULT_MODEL_NAME, prompt=prompt_of(0), max_tokens=MAX_TOKENS, temperature=0
    )
    assert completion.choices[0].text == expected_texts[0]


def test_killed_actor_restarts_the_core_and_streams_resume(
    server: RemoteServer, expected_texts: list[str]
) -> None:
    old_actors = actor_pids(server)
    # The failed core and everything below it: its Ray instance (which it started) and actors.
    old_processes = core_tree(server)
    prompts: list[str | list[int]] = [prompt_of(i) for i in range(NUM_STREAMS)]
    results = stream_all(server, prompts, lambda: os.kill(old_actors[-1], signal.SIGKILL))
    assert_intact(results, expected_texts)
    # The core names the dead actor, or, when its step's read failed before the actor monitor
    # reported (a loaded machine: it waits 10 s for the monitor), the Ray workers' failure.
    log = full_log(server)
    assert "(Ray actor) died" in log or "the Ray workers failed" in log
    wait_gone(old_processes)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    wait_until(lambda: len(actor_pids(server)) == WORLD_SIZE, 60, "the new actors run")
    assert not set(actor_pids(server)) & set(old_actors)


def test_sigterm_stops_every_process(server: RemoteServer) -> None:
    # Last of the module's tests on the shared server: it stops it.
    processes = descendant_pids(server.process.pid)
    assert server.stop(signal.SIGTERM) == 0, server.log()
    wait_gone(processes)


def test_data_parallel_replicas_on_one_shared_cluster(
    tmp_path_factory: pytest.TempPathFactory, expected_texts: list[str]
) -> None:
    # The server starts one Ray instance; both replicas' cores join it (a core that started
    # its own would hold a second instance below it).
    args = ["-dp", "2", "--distributed-executor-backend", "ray", "--max-model-len", "512"]
    remote = RemoteServer(args, tmp_path_factory.mktemp("ray_dp") / "server.log")
    try:
        cores = [p for p in descendant_pids(remote.process.pid) if b"spawn_main" in _cmdline(p)]
        assert len(cores) == 2
        for core in cores:
            assert not [p for p in descendant_pids(core) if b"raylet" in _cmdline(p)]
        assert len(actor_pids(remote)) == 2
        client = remote.client()
        for i in range(2):
            completion = client.completions.create(
                model=DEFAULT_MODEL_NAME, prompt=prompt_of(i), max_tokens=MAX_TOKENS, temperature=0
            )
            assert completion.choices[0].text == expected_texts[i]
        metrics = httpx.get(remote.url + "/metrics", timeout=10).text
        assert 'engine="0"' in metrics and 'engine="1"' in metrics
    finally:
        processes = descendant_pids(remote.process.pid)
        assert remote.stop(signal.SIGTERM) == 0, remote.log()
        wait_gone(processes)
