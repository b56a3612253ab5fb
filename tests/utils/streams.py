"""Concurrent greedy completion streams against a live server, for the fault tests: each
stream's text, finish reason and in-band error."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import torch

from ferrum import LLM, SamplingParams
from tests.utils.remote_server import RemoteServer

MAX_TOKENS = 24


def prompt_of(i: int) -> str:
    return f"Story {i}: a short tale about the sea and {i * 7} friends"


@dataclass
class StreamResult:
    text: str
    finish_reason: str | None
    error: dict | None


async def _stream(
    client: httpx.AsyncClient, url: str, prompt: str | list[int], started: asyncio.Event
) -> StreamResult:
    """One greedy stream of MAX_TOKENS; sets `started` once it has received text."""
    body = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    result = StreamResult("", None, None)
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                result.error = chunk["error"]
                continue
            choice = chunk["choices"][0]
            result.text += choice["text"]
            result.finish_reason = choice["finish_reason"] or result.finish_reason
            if result.text:
                started.set()
    started.set()
    return result


def stream_all(
    server: RemoteServer,
    prompts: list[str | list[int]],
    once_all_started: Callable[[], None] | None = None,
) -> list[StreamResult]:
    """Streams every prompt concurrently until all end; calls `once_all_started()` as soon as
    every stream has received text (or ended)."""

    async def run() -> list[StreamResult]:
        started = [asyncio.Event() for _ in prompts]
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [
                asyncio.create_task(_stream(client, server.url, p, e))
                for p, e in zip(prompts, started)
            ]
            if once_all_started is not None:
                for event in started:
                    await event.wait()
                once_all_started()
            return await asyncio.gather(*tasks)

    return asyncio.run(run())


def full_log(server: RemoteServer) -> str:
    return server.log_path.read_text(errors="replace")


def assert_intact(results: list[StreamResult], expected: list[str]) -> None:
    for i, (result, text) in enumerate(zip(results, expected, strict=True)):
        assert result.error is None, f"stream {i}: {result.error}"
        assert result.finish_reason == "length", f"stream {i}"
        assert result.text == text, f"stream {i}"


def expected_stream_texts(llm: LLM, num_streams: int) -> list[str]:
    """One process's greedy outputs of the first `num_streams` streams' prompts, on one torch
    thread as a server's core runs (spinning OpenMP workers on a busy machine slow the tiny
    model down by orders of magnitude)."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [prompt_of(i) for i in range(num_streams)]
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        torch.set_num_threads(num_threads)
    return [o.outputs[0].text for o in outputs]
