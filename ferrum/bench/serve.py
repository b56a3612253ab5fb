"""Online load generator for any OpenAI-compatible server (TTFT, TPOT, ITL, E2EL, throughput).

Requests stream with `include_usage` and `ignore_eos`, so output lengths are the server's counts.
A request succeeds only if its stream carried output and ended with `data: [DONE]`; anything else
is a failure with its error string. Exit code 0 when at least one request completed, else 1."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from ferrum.bench.serve_datasets import (
    DATASETS,
    SampleRequest,
    prefix_dataset,
    random_dataset,
    sharegpt_dataset,
)
from ferrum.bench.serve_metrics import RequestRecord, format_summary, parse_goodput, summarize
from ferrum.bench.serve_spec_metrics import parse_spec_counters, spec_decode_summary

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
# Connection pool size when --max-concurrency is not given.
DEFAULT_MAX_CONNECTIONS = 1024
# Error strings longer than this are cut (a server may answer with a whole HTML page).
MAX_ERROR_CHARS = 300


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every flag's help states its default (unless it says it already, or there is none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = _HelpFormatter
    server = parser.add_argument_group("server")
    server.add_argument(
        "--base-url", default=None, help="e.g. http://127.0.0.1:8000 (else host+port)"
    )
    server.add_argument("--host", default="127.0.0.1", help="server address")
    server.add_argument("--port", type=int, default=8000, help="server port")
    server.add_argument(
        "--endpoint", default="/v1/completions", choices=ENDPOINTS, help="endpoint to load"
    )
    server.add_argument(
        "--model",
        default=None,
        help="model name in requests, and its tokenizer if it is a folder (default: the "
        "server's first model)",
    )
    server.add_argument(
        "--served-model-name",
        default=None,
        help="model name in requests when it differs from --model (default: --model)",
    )
    server.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer folder (default: --model if it is a folder, else the shipped model's)",
    )
    server.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    lora_help = "LoRA adapter names: request i names adapter i mod N (vLLM's: a random one)"
    server.add_argument("--lora-modules", nargs="+", default=None, help=lora_help)
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=DATASETS, default="random", help="prompts")
    data.add_argument("--dataset-path", default=None, help="ShareGPT-style JSON file")
    data.add_argument("--num-prompts", type=int, default=1000, help="requests to send")
    data.add_argument("--random-input-len", type=int, default=1024, help="(prefix: suffix len)")
    data.add_argument("--random-output-len", type=int, default=128, help="tokens per reply")
    data.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths in L*(1±r)")
    data.add_argument("--prefix-len", type=int, default=256, help="shared prefix tokens")
    data.add_argument("--num-prefix-groups", type=int, default=4, help="distinct prefixes")
    data.add_argument("--sharegpt-output-len", type=int, default=None)
    data.add_argument("--seed", type=int, default=0, help="dataset and sampling seed")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson req/s")
    load.add_argument("--max-concurrency", type=int, default=None, help="requests in flight")
    load.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    load.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    out = parser.add_argument_group("output")
    out.add_argument("--goodput", nargs="+", default=None, help="SLOs, e.g. ttft:500 tpot:50")
    out.add_argument("--save-result", action="store_true", help="write the result JSON")
    out.add_argument("--result-filename", default=None, help="result JSON path (implies save)")
    out.add_argument("--disable-tqdm", action="store_true")


def main(args: argparse.Namespace) -> int:
    _check_args(args)
    slos = parse_goodput(args.goodput)
    base_url = resolve_base_url(args.base_url, args.host, args.port)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.served_model_name or args.model
    if model is None:
        model = asyncio.run(fetch_first_model(base_url, headers, args.request_timeout))
    tokenizer_path = resolve_tokenizer_path(args.tokenizer, args.model or model)
    samples = build_dataset(args, tokenizer_path)
    counters_before = asyncio.run(fetch_spec_counters(base_url, headers, args.request_timeout))
    records, duration = asyncio.run(
        run_benchmark(
            base_url + args.endpoint,
            model,
            samples,
            headers=headers,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            request_timeout=args.request_timeout,
            temperature=args.temperature,
            seed=args.seed,
            disable_tqdm=args.disable_tqdm,
            lora_modules=args.lora_modules,
        )
    )
    result = summarize(records, duration, slos)
    counters_after = asyncio.run(fetch_spec_counters(base_url, headers, args.request_timeout))
    if counters_before is not None and counters_after is not None:
        result["spec_decode"] = spec_decode_summary(counters_before, counters_after)
    print(format_summary(result))
    if args.save_result or args.result_filename:
        result = {
            "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
            "endpoint": args.endpoint,
            "base_url": base_url,
            "model_id": model,
            "tokenizer_id": tokenizer_path,
            "dataset_name": args.dataset_name,
            "num_prompts": len(samples),
            "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
            "max_concurrency": args.max_concurrency,
            "goodput_slos_ms": slos or None,
            **result,
        }
        path = args.result_filename or _default_result_filename(args, model)
        Path(path).write_text(json.dumps(result, indent=2), encoding="utf-8")
        print(f"result written to {path}")
    return 0 if result["completed"] > 0 else 1


def resolve_base_url(base_url: str | None, host: str, port: int) -> str:
    """The server root without a trailing slash or `/v1` (endpoints carry `/v1`)."""
    url = (base_url or f"http://{host}:{port}").rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"base_url must start with http:// or https://, got {url!r}")
    return url.removesuffix("/v1")


def resolve_tokenizer_path(tokenizer: str | None, model: str) -> str:
    """--tokenizer, else the model if it is a folder, else the shipped model's tokenizer (prompt
    lengths are then counted in its tokens: the server's counts may differ)."""
    from ferrum.default_model import DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME

    if tokenizer:
        return tokenizer
    if Path(model).is_dir():
        return model
    if model != DEFAULT_MODEL_NAME:
        print(
            f"bench serve: {model!r} is not a local folder; prompts are built with the shipped "
            "model's tokenizer (give --tokenizer for the server's)",
            file=sys.stderr,
        )
    return DEFAULT_MODEL_DIR


def build_dataset(args: argparse.Namespace, tokenizer_path: str) -> list[SampleRequest]:
    from ferrum.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(tokenizer_path)
    chat = args.endpoint == "/v1/chat/completions"
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("dataset_path is required for dataset_name 'sharegpt'")
        return sharegpt_dataset(
            tokenizer, args.dataset_path, args.num_prompts, args.seed, args.sharegpt_output_len
        )
    common = (args.random_output_len, args.random_range_ratio, args.seed, chat)
    if args.dataset_name == "prefix":
        return prefix_dataset(
            tokenizer,
            args.num_prompts,
            args.prefix_len,
            args.num_prefix_groups,
            args.random_input_len,
            *common,
        )
    return random_dataset(tokenizer, args.num_prompts, args.random_input_len, *common)


async def fetch_first_model(base_url: str, headers: dict[str, str], timeout: float) -> str:
    import aiohttp

    client_timeout = aiohttp.ClientTimeout(total=timeout)
    try:
        async with (
            aiohttp.ClientSession(timeout=client_timeout) as session,
            session.get(base_url + "/v1/models", headers=headers) as response,
        ):
            response.raise_for_status()
            return (await response.json())["data"][0]["id"]
    except (TimeoutError, aiohttp.ClientError, KeyError, IndexError, TypeError) as e:
        raise ValueError(
            f"model not given and {base_url}/v1/models did not name one: {_describe(e)}"
        ) from None


def build_payload(
    endpoint_url: str, model: str, sample: SampleRequest, temperature: float
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": temperature,
    }
    if endpoint_url.endswith("/chat/completions"):
        payload["messages"] = [{"role": "user", "content": sample.prompt_text}]
        payload["max_completion_tokens"] = sample.output_len
    else:
        payload["prompt"] = sample.prompt_token_ids
        payload["max_tokens"] = sample.output_len
    return payload


async def send_request(
    session: Any, url: str, payload: dict[str, Any], headers: dict[str, str], prompt_len: int
) -> RequestRecord:
    """One streaming request; never raises for server or network trouble (see the module doc)."""
    import aiohttp

    record = RequestRecord(prompt_len=prompt_len)
    chat = url.endswith("/chat/completions")
    start = last = time.perf_counter()
    num_chunks, usage_tokens, done = 0, None, False
    try:
        async with session.post(url, json=payload, headers=headers) as response:
            if response.status != 200:
                body = (await response.text())[:MAX_ERROR_CHARS]
                record.error = f"HTTP {response.status}: {body}"
                return record
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = f"stream error: {json.dumps(chunk['error'])[:MAX_ERROR_CHARS]}"
                    return record
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                if _chunk_text(chunk, chat):
                    now = time.perf_counter()
                    if num_chunks == 0:
                        record.ttft = now - start
                    else:
                        record.itl.append(now - last)
                    last = now
                    num_chunks += 1
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
        record.error = _describe(e)
        return record
    record.latency = time.perf_counter() - start
    if not done:
        record.error = "stream ended without data: [DONE]"
    elif num_chunks == 0:
        record.error = "stream carried no output"
    else:
        record.output_len = usage_tokens if usage_tokens is not None else num_chunks
        record.success = True
    return record


def _chunk_text(chunk: dict[str, Any], chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if chat:
        delta = choices[0].get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choices[0].get("text") or ""


def _describe(error: BaseException) -> str:
    text = str(error) or "(no message)"
    if isinstance(error, TimeoutError):
        text = "request timed out"
    return f"{type(error).__name__}: {text}"[:MAX_ERROR_CHARS]


async def run_benchmark(
    url: str,
    model: str,
    samples: list[SampleRequest],
    *,
    headers: dict[str, str] | None = None,
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
    request_timeout: float = 600.0,
    temperature: float = 0.0,
    seed: int = 0,
    disable_tqdm: bool = True,
    lora_modules: list[str] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Sends every sample (Poisson arrivals at `request_rate`, at most `max_concurrency` in
    flight) and returns the records in sample order and the wall time in seconds. With
    `lora_modules`, sample i names adapter i mod their number instead of `model`."""
    import aiohttp
    from tqdm import tqdm

    rng = random.Random(seed)
    limit = max_concurrency or DEFAULT_MAX_CONNECTIONS
    slots = asyncio.Semaphore(limit)
    connector = aiohttp.TCPConnector(limit=limit)
    timeout = aiohttp.ClientTimeout(total=request_timeout)
    records: list[RequestRecord | None] = [None] * len(samples)
    progress = tqdm(total=len(samples), disable=disable_tqdm)

    async def one(index: int, sample: SampleRequest, session: aiohttp.ClientSession) -> None:
        try:
            name = lora_modules[index % len(lora_modules)] if lora_modules else model
            payload = build_payload(url, name, sample, temperature)
            records[index] = await send_request(
                session, url, payload, headers or {}, sample.prompt_len
            )
        finally:
            slots.release()
            progress.update(1)

    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks: set[asyncio.Task[None]] = set()
        for index, sample in enumerate(samples):
            await slots.acquire()
            task = asyncio.create_task(one(index, sample, session))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            if request_rate != float("inf") and index + 1 < len(samples):
                await asyncio.sleep(rng.expovariate(request_rate))
        if tasks:
            await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    progress.close()
    return [r for r in records if r is not None], duration


async def fetch_spec_counters(
    base_url: str, headers: dict[str, str], timeout: float
) -> dict[str, Any] | None:
    """The server's spec_decode counters (`/metrics`), or None when it has no /metrics."""
    import aiohttp

    client_timeout = aiohttp.ClientTimeout(total=timeout)
    try:
        async with (
            aiohttp.ClientSession(timeout=client_timeout) as session,
            session.get(base_url + "/metrics", headers=headers) as response,
        ):
            if response.status != 200:
                return None
            return parse_spec_counters(await response.text())
    except (aiohttp.ClientError, TimeoutError):
        return None


def _default_result_filename(args: argparse.Namespace, model: str) -> str:
    rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}"
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"ferrum-serve-{rate}qps-{Path(model).name}-{stamp}.json"


def _check_args(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {args.num_prompts}")
    if not args.request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (inf = all at once), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {args.max_concurrency}")
    if not args.request_timeout > 0:
        raise ValueError(f"request_timeout must be > 0, got {args.request_timeout}")
    if args.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {args.temperature}")
