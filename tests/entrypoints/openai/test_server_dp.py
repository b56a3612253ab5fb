"""`ferrum serve -dp 2`: two engine cores behind one server. Concurrent requests spread over
both (per-engine metrics) and all complete with the text one core gives; a dropped stream frees
the KV blocks of its own replica while the other keeps running; a poison request crashes and
restarts only its own replica, while a stream on the other goes on in the same core."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ferrum.default_model import DEFAULT_MODEL_NAME
from tests.utils.remote_server import RemoteServer

MODEL = DEFAULT_MODEL_NAME
NUM_REQUESTS = 8
# A prompt holding this token id crashes every forward it is in (no text prompt tokenizes to it).
POISON_TOKEN_ID = 8191


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    log = tmp_path_factory.mktemp("dp_server") / "server.log"
    remote = RemoteServer(
        ["-dp", "2", "--max-model-len", "512"],
        log,
        env={"FERRUM_DEBUG_FAIL_ON_TOKEN": str(POISON_TOKEN_ID)},
    )
    yield remote
    code = remote.stop()
    assert code == 0, remote.log()


def per_engine(server: RemoteServer, name: str) -> dict[str, float]:
    """engine label -> value of one per-core sample."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {
        s.labels["engine"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def wait_for(server: RemoteServer, name: str, check, timeout: float = 30.0) -> dict[str, float]:
    """Polls a per-engine metric until `check(values)`; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        values = per_engine(server, name)
        if check(values):
            return values
        assert time.monotonic() < deadline, f"{name} never passed the check: {values}"
        time.sleep(0.05)


def test_requests_spread_over_both_replicas_and_all_complete(dp_server: RemoteServer) -> None:
    steps = "ferrum:iteration_tokens_total_count"
    before = per_engine(dp_server, steps)
    assert set(before) == {"0", "1"}
    prompts = [f"Story {i}: a tale about the sea and {i} friends" for i in range(NUM_REQUESTS)]

    async def run_all() -> list[str]:
        async with dp_server.async_client() as client:
            results = await asyncio.gather(
                *(
                    client.completions.create(
                        model=MODEL,
                        prompt=p,
                        max_tokens=6,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    for p in prompts
                )
            )
        return [r.choices[0].text for r in results]

    texts = asyncio.run(run_all())
    assert all(texts)
    after = per_engine(dp_server, steps)
    assert all(after[e] > before[e] for e in ("0", "1")), (before, after)
    # Greedy text does not depend on the replica: each prompt alone gives the same.
    client = dp_server.client()
    for prompt, text in zip(prompts[:2], texts):
        alone = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        assert alone.choices[0].text == text
    wait_for(dp_server, "ferrum:num_requests_running", lambda v: sum(v.values()) == 0)


@contextlib.contextmanager
def open_stream(server: RemoteServer, max_tokens: int = 500) -> Iterator[Iterator[str]]:
    """A long streamed completion, open (its first tokens read) until the block ends; yields
    the rest of its SSE lines."""
    body = {"model": MODEL, "prompt": "Tell me everything", "max_tokens": max_tokens}
    body |= {"stream": True, "ignore_eos": True, "temperature": 0}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", server.url + "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        # Held until the end: a collected line iterator would close the connection.
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: ") and json.loads(line[6:])["choices"]:
                break
        yield lines
    # Leaving the blocks closes the connection mid-stream: the server aborts the request.


def finished_count(server: RemoteServer, reason: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "ferrum:request_success_total" and s.labels["finished_reason"] == reason
    )


def test_a_dropped_stream_frees_its_own_replicas_kv(dp_server: RemoteServer) -> None:
    kv = "ferrum:kv_cache_usage_perc"
    wait_for(dp_server, kv, lambda v: set(v.values()) == {0.0})
    aborted, done = finished_count(dp_server, "abort"), finished_count(dp_server, "length")
    with open_stream(dp_server):
        first = wait_for(dp_server, kv, lambda v: max(v.values()) > 0)
        other = "1" if max(first, key=first.__getitem__) == "0" else "0"
        with open_stream(dp_server):
            wait_for(dp_server, kv, lambda v: v[other] > 0)
        # The second stream ran on the other replica (the least loaded); dropping it aborts it
        # there (an abort sent elsewhere would leave it running to its length limit).
        wait_for(dp_server, kv, lambda v: v[other] == 0)
        assert per_engine(dp_server, "ferrum:num_requests_running")[other] == 0
        assert finished_count(dp_server, "abort") == aborted + 1
        assert finished_count(dp_server, "length") == done
    wait_for(dp_server, kv, lambda v: set(v.values()) == {0.0})
    wait_for(dp_server, "ferrum:num_requests_running", lambda v: sum(v.values()) == 0)


def core_pids(server: RemoteServer) -> set[int]:
    """The server's engine core processes (spawned multiprocessing children)."""
    pid = server.process.pid
    pids = set()
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"multiprocessing.spawn" in cmdline and b"resource_tracker" not in cmdline:
            pids.add(int(child))
    return pids


def test_a_poison_request_restarts_only_its_replica(dp_server: RemoteServer) -> None:
    kv = "ferrum:kv_cache_usage_perc"
    wait_for(dp_server, kv, lambda v: set(v.values()) == {0.0})
    cores = core_pids(dp_server)
    assert len(cores) == 2
    client = dp_server.client()
    with open_stream(dp_server, max_tokens=60) as lines:
        # The stream holds one replica: the poison request goes to the other, crashes its core
        # twice (the second time running alone) and is failed alone.
        body = {"model": MODEL, "prompt": [1, 2, POISON_TOKEN_ID, 3], "max_tokens": 4}
        response = httpx.post(dp_server.url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 500, response.text
        assert response.json()["error"]["code"] == "request_crashed_engine"
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
    # The stream's core is the same process; the poisoned replica's was replaced twice.
    deadline = time.monotonic() + 30  # a killed core may take a moment to leave the table
    while len(after := core_pids(dp_server)) != 2:
        assert time.monotonic() < deadline, after
        time.sleep(0.05)
    assert len(cores & after) == 1, (cores, after)
    full_log = dp_server.log_path.read_text(errors="replace")
    assert full_log.count("starting engine core #") == 2
    assert httpx.get(dp_server.url + "/health", timeout=10).status_code == 200
    done = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
    assert done.choices[0].finish_reason == "length"
