"""Concurrent streams get what they get alone; disconnected clients free their KV blocks."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx

from ferrum.default_model import DEFAULT_MODEL_NAME
from tests.utils.remote_server import RemoteServer

MODEL = DEFAULT_MODEL_NAME
NUM_CONCURRENT = 32
TOPICS = ["cats", "the sea", "rockets", "bread", "winter", "music", "a city", "trees"]


def prompt_of(i: int) -> str:
    return f"Story {i}: a short tale about {TOPICS[i % len(TOPICS)]} and {i * 7} friends"


def wait_for_idle(server: RemoteServer, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        idle = (
            metrics["ferrum:num_requests_running"] == 0
            and metrics["ferrum:num_requests_waiting"] == 0
            and metrics["ferrum:kv_cache_usage_perc"] == 0
        )
        if idle or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def aborted_count(server: RemoteServer) -> float:
    text = httpx.get(server.url + "/metrics", headers=server.headers, timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("ferrum:request_success_total") and 'finished_reason="abort"' in line
    )


def test_concurrent_streams_match_solo_runs(server: RemoteServer) -> None:
    client = server.client()
    solo = [
        client.completions.create(
            model=MODEL,
            prompt=prompt_of(i),
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
        for i in range(NUM_CONCURRENT)
    ]

    async def stream_one(aclient: object, i: int) -> tuple[str, int]:
        stream = await aclient.completions.create(  # type: ignore[attr-defined]
            model=MODEL,
            prompt=prompt_of(i),
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage = "", 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return text, usage

    async def run_all() -> list[tuple[str, int]]:
        aclient = server.async_client()
        async with aclient:
            return await asyncio.wait_for(
                asyncio.gather(*(stream_one(aclient, i) for i in range(NUM_CONCURRENT))), 120
            )

    results = asyncio.run(run_all())
    assert [text for text, _ in results] == solo
    assert all(num_tokens == 12 for _, num_tokens in results)


def _open_stream_and_drop(server: RemoteServer, started: threading.Barrier) -> None:
    body = {
        "model": MODEL,
        "prompt": "Tell me everything",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST", server.url + "/v1/completions", json=body, headers=server.headers
        ) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        received = 0
        for line in lines:
            if line.startswith("data: ") and json.loads(line[6:])["choices"]:
                received += 1
                if received == 3:
                    break
        started.wait(30)
    # Leaving the blocks closes the connection mid-stream.


def test_disconnected_streams_are_aborted_and_free_kv(server: RemoteServer) -> None:
    wait_for_idle(server)
    aborted_before = aborted_count(server)
    barrier = threading.Barrier(4)
    threads = [
        threading.Thread(target=_open_stream_and_drop, args=(server, barrier)) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    metrics = wait_for_idle(server, timeout=10)
    assert metrics["ferrum:kv_cache_usage_perc"] == 0
    assert metrics["ferrum:num_requests_running"] == 0
    assert aborted_count(server) - aborted_before == 4
    # The server keeps serving.
    result = server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    assert result.choices[0].text is not None and result.usage.completion_tokens >= 1


def test_disconnected_non_streaming_request_is_aborted(server: RemoteServer) -> None:
    wait_for_idle(server)
    aborted_before = aborted_count(server)
    body = json.dumps(
        {"model": MODEL, "prompt": "Go on and on", "max_tokens": 450, "ignore_eos": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {server.api_key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        conn.sendall(head + body)
        deadline = time.monotonic() + 30
        while server.metrics()["ferrum:num_requests_running"] < 1:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
    # The connection is closed while the request runs.
    metrics = wait_for_idle(server, timeout=10)
    assert metrics["ferrum:kv_cache_usage_perc"] == 0
    assert aborted_count(server) - aborted_before == 1
