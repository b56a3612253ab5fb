"""The hostile-client soak of `soak_server.py --hostile` (issue 36): well-behaved users stream
completions while hostile requests arrive: lists far past the limits (a million stop strings in
13 MB, 300k bad words, 100k choices, 500k content parts), JSON nested hundreds of levels, and
requests right at the limits (1024 stop strings, 1024 bad words, 1024 choices), which are served.
Each phase runs --rounds rounds of the same users: alone, beside as many plain requests as there
are hostile ones (the load any request adds), and beside the hostile requests. The users' token
gaps (p50, p99, max), first-token times and /health latencies of each phase are reported; the
bodies are encoded before the clock starts, so the client's own JSON work is not measured."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from ferrum.default_model import DEFAULT_MODEL_NAME

_USERS = 4
_USER_TOKENS = 96


def _nested(depth: int) -> Any:
    value: Any = {"type": "integer"}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def _chat(**fields: Any) -> tuple[str, dict[str, Any]]:
    messages = fields.pop("messages", [{"role": "user", "content": "hi"}])
    return "/v1/chat/completions", {"messages": messages, "max_tokens": 8, **fields}


def _completion(**fields: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, **fields}


def hostile_requests() -> dict[str, dict[str, tuple[str, dict[str, Any]]]]:
    """Kind ("huge_bodies": 1-16 MB past a list limit, "small") -> name -> (path, body); names
    ending in `_limit` are right at a limit and are served, the others are refused (400)."""
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": ""}}
    call["function"]["arguments"] = json.dumps(_nested(900))
    long_stream = {"max_tokens": 128, "ignore_eos": True, "stream": True}
    parts = [{"type": "text", "text": ""}] * 500_000
    huge = {
        "stop_1M": _completion(stop=[f"s{i:07d}" for i in range(1_000_000)]),
        "bad_words_300k": _completion(bad_words=[f"w{i}" for i in range(300_000)]),
        "choice_100k": _completion(
            structured_outputs={"choice": [f"c{i}" for i in range(100_000)]}
        ),
        "parts_500k": _chat(messages=[{"role": "user", "content": parts}]),
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": _nested(300)}}
    small = {
        "template_kwargs_490_deep": _chat(chat_template_kwargs={"x": _nested(490)}),
        "tool_schema_300_deep": _chat(tools=[tool], tool_choice="none"),
        "tool_arguments_900_deep": _chat(
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [call]},
            ]
        ),
        "stop_limit": _completion(stop=[f"{i:015d}x" for i in range(1024)], **long_stream),
        "stop_one_last_char_limit": _completion(
            stop=["e" * n for n in range(2, 181)], **long_stream
        ),
        "bad_words_limit": _completion(
            bad_words=[f"word{i:011d}" for i in range(1024)], max_tokens=64
        ),
        "choice_limit": _completion(
            structured_outputs={"choice": [f"option{i:09d}" for i in range(1024)]}
        ),
    }
    return {"huge_bodies": huge, "small": small}


def _plain_requests(count: int) -> dict[str, tuple[str, dict[str, Any]]]:
    return {
        f"plain_{i}": _completion(max_tokens=128, ignore_eos=True, stream=True)
        for i in range(count)
    }


async def _user(
    session: aiohttp.ClientSession, url: str, gaps: list[float], ttfts: list[float]
) -> None:
    body = {"model": DEFAULT_MODEL_NAME, "prompt": "The history of tables", "stream": True}
    body.update(max_tokens=_USER_TOKENS, ignore_eos=True, temperature=0.0)
    started = time.perf_counter()
    last = None
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            now = time.perf_counter()
            if last is None:
                ttfts.append(now - started)
            else:
                gaps.append(now - last)
            last = now


async def _send(
    session: aiohttp.ClientSession, url: str, name: str, path: str, raw: bytes, out: dict
) -> None:
    started = time.perf_counter()
    headers = {"content-type": "application/json"}
    async with session.post(url + path, data=raw, headers=headers) as response:
        text = await response.read()
    seconds = round(time.perf_counter() - started, 2)
    message = "" if response.status == 200 else json.loads(text)["error"]["message"][:90]
    out.setdefault(name, []).append({"status": response.status, "s": seconds, "error": message})


async def _health(
    session: aiohttp.ClientSession, url: str, latencies: list[float], done: asyncio.Event
) -> None:
    while not done.is_set():
        started = time.perf_counter()
        async with session.get(url + "/health") as response:
            await response.read()
        latencies.append(time.perf_counter() - started)
        await asyncio.sleep(0.05)


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(len(ordered) * fraction), len(ordered) - 1)] if ordered else 0.0


async def _phase(
    session: aiohttp.ClientSession,
    url: str,
    bodies: dict[str, tuple[str, bytes]],
    rounds: int,
    sequential: bool = False,
) -> dict:
    gaps: list[float] = []
    ttfts: list[float] = []
    health: list[float] = []
    answers: dict[str, list[dict]] = {}
    for _ in range(rounds):
        done = asyncio.Event()
        prober = asyncio.create_task(_health(session, url, health, done))
        users = [asyncio.create_task(_user(session, url, gaps, ttfts)) for _ in range(_USERS)]
        await asyncio.sleep(0.5)  # the users are streaming
        if sequential:  # one body at a time: the stall each one costs
            for name, (path, raw) in bodies.items():
                await _send(session, url, name, path, raw, answers)
        else:
            sends = (_send(session, url, n, p, raw, answers) for n, (p, raw) in bodies.items())
            await asyncio.gather(*sends)
        await asyncio.gather(*users)
        done.set()
        await prober
    ms = lambda seconds: round(seconds * 1000)  # noqa: E731
    return {
        "gap_p50_ms": ms(_percentile(gaps, 0.5)),
        "gap_p99_ms": ms(_percentile(gaps, 0.99)),
        "gap_max_ms": ms(max(gaps)),
        "ttft_max_ms": ms(max(ttfts)),
        "health_max_ms": ms(max(health)),
        "answers": {
            name: runs[0] | {"max_s": max(r["s"] for r in runs)} for name, runs in answers.items()
        },
    }


async def hostile_soak(args: Any, wait_healthy: Callable[..., Awaitable[None]]) -> dict:
    """Phases "alone", "plain", "hostile_small" (deep JSON, lists at the limits, all at once)
    and "huge_bodies" (one after the other), `args.rounds` rounds each; see the module docs."""
    encoded = {
        kind: {name: (path, json.dumps(body).encode()) for name, (path, body) in bodies.items()}
        for kind, bodies in hostile_requests().items()
    }
    plain = _plain_requests(len(encoded["small"]))
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await wait_healthy(session, args.base_url, args.startup_timeout)
        # The first grammar imports xgrammar (and torch) into the API process: once per server.
        path, body = _completion(structured_outputs={"choice": ["yes", "no"]})
        await _send(session, args.base_url, "warm_up", path, json.dumps(body).encode(), {})
        summary: dict[str, Any] = {"rounds": args.rounds, "users": _USERS}
        summary["user_tokens"] = _USER_TOKENS
        for phase, bodies, sequential in (
            ("alone", {}, False),
            ("plain", {n: (p, json.dumps(b).encode()) for n, (p, b) in plain.items()}, False),
            ("hostile_small", encoded["small"], False),
            ("huge_bodies", encoded["huge_bodies"], True),
        ):
            summary[phase] = await _phase(session, args.base_url, bodies, args.rounds, sequential)
    answers = {**summary["hostile_small"]["answers"], **summary["huge_bodies"]["answers"]}
    summary["errors"] = [
        name
        for name, answer in answers.items()
        if (answer["status"] == 200) != name.endswith("_limit") or answer["status"] >= 500
    ]
    return summary
