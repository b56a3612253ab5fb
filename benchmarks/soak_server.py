"""Soak a ferrum server with streaming requests, a share of whose clients hang up mid-stream.

Starts `ferrum serve` on the shipped model on loopback (CPU, float32) unless --base-url is given,
sends --requests streaming completions at --concurrency, and drops a random --disconnect-fraction
of them after a random number of chunks. Then it waits for the server to go idle and reads
/metrics: every kept stream must end with [DONE], and the KV cache must be empty again (no leaked
blocks). Prints one summary line per figure and writes JSON with --out. With --hostile, instead:
streams of well-behaved users run while hostile requests (issue 36: huge lists, deep JSON) arrive,
and the users' token gaps are compared with rounds of plain requests (hostile_requests.py).

    python benchmarks/soak_server.py --requests 1000 --concurrency 128 --disconnect-fraction 0.3
    python benchmarks/soak_server.py --hostile --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hostile_requests import hostile_soak
from ferrum.default_model import DEFAULT_MODEL_NAME

_IDLE_GAUGES = (
    "ferrum:num_requests_running",
    "ferrum:num_requests_waiting",
    "ferrum:kv_cache_usage_perc",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, max_num_seqs: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "ferrum", "serve", "--device", "cpu", "--dtype", "float32"]
    command += ["--port", str(port), "--max-num-seqs", str(max_num_seqs)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def wait_healthy(session: aiohttp.ClientSession, base_url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            async with session.get(base_url + "/health") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError(f"{base_url}/health did not answer 200 within {timeout:.0f} s")


async def read_metrics(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    async with session.get(base_url + "/metrics") as response:
        text = await response.text()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("ferrum:"):
            sample, value = line.rsplit(" ", 1)
            name = sample.split("{", 1)[0]
            values[name] = values.get(name, 0.0) + float(value)
    missing = [name for name in _IDLE_GAUGES if name not in values]
    if missing:
        raise RuntimeError(f"/metrics lacks {missing}")
    return values


async def one_request(
    session: aiohttp.ClientSession, base_url: str, index: int, drop_after: int | None, args
) -> str:
    """Returns "completed", "dropped" or an error description."""
    body = {
        "model": DEFAULT_MODEL_NAME,
        "prompt": f"Request {index}: a short note about tables and indexes number {index * 13}",
        "max_tokens": args.max_tokens,
        "stream": True,
        "temperature": 0.8,
        "seed": index,
    }
    try:
        async with session.post(base_url + "/v1/completions", json=body) as response:
            if response.status != 200:
                return f"HTTP {response.status}"
            chunks = 0
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                if line.strip() == b"data: [DONE]":
                    return "completed"
                chunks += 1
                if drop_after is not None and chunks >= drop_after:
                    response.close()  # the client hangs up mid-stream
                    return "dropped"
            return "dropped" if drop_after is not None else "stream ended without [DONE]"
    except (TimeoutError, aiohttp.ClientError) as e:
        return f"{type(e).__name__}: {e}"


async def soak(args) -> dict:
    rng = random.Random(args.seed)
    plan = [
        rng.randint(1, args.max_tokens // 2) if rng.random() < args.disconnect_fraction else None
        for _ in range(args.requests)
    ]
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await wait_healthy(session, args.base_url, args.startup_timeout)
        gate = asyncio.Semaphore(args.concurrency)

        async def run(index: int) -> str:
            async with gate:
                return await one_request(session, args.base_url, index, plan[index], args)

        started = time.perf_counter()
        results = await asyncio.gather(*(run(i) for i in range(args.requests)))
        elapsed = time.perf_counter() - started
        deadline = time.monotonic() + 30
        while True:
            metrics = await read_metrics(session, args.base_url)
            idle = all(metrics[name] == 0.0 for name in _IDLE_GAUGES)
            if idle or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
    errors = [r for r in results if r not in ("completed", "dropped")]
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "disconnect_fraction": args.disconnect_fraction,
        "max_tokens": args.max_tokens,
        "completed": results.count("completed"),
        "dropped_by_client": results.count("dropped"),
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:5],
        "kv_cache_usage_after": metrics["ferrum:kv_cache_usage_perc"],
        "running_after": metrics["ferrum:num_requests_running"],
        "waiting_after": metrics["ferrum:num_requests_waiting"],
        "elapsed_s": round(elapsed, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None, help="an already running server")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--disconnect-fraction", type=float, default=0.3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--startup-timeout", type=float, default=120.0)
    parser.add_argument("--out", default=None, help="write the summary as JSON here")
    parser.add_argument("--hostile", action="store_true", help="the hostile-client soak")
    parser.add_argument("--rounds", type=int, default=5, help="--hostile: rounds per phase")
    args = parser.parse_args()
    server = None
    if args.base_url is None:
        port = free_port()
        server = start_server(port, max_num_seqs=args.concurrency)
        args.base_url = f"http://127.0.0.1:{port}"
    try:
        summary = asyncio.run(hostile_soak(args, wait_healthy) if args.hostile else soak(args))
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
    for key, value in summary.items():
        print(f"{key:24s} {value}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    if summary.get("errors") or summary.get("kv_cache_usage_after"):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
