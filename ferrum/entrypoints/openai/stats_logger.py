"""The server's periodic stats line, vLLM's: every FERRUM_LOG_STATS_INTERVAL seconds (10) while
the engine has work, "Avg prompt throughput, Avg generation throughput, Running, Waiting, KV cache
usage, Prefix cache hit rate" from `AsyncLLM.stats()`; off with --disable-log-stats. And, at
DEBUG, one line per finished request (id, tokens, reason, latency)."""

from __future__ import annotations

import asyncio
import logging
import time

from ferrum import envs
from ferrum.engine.async_llm import AsyncLLM
from ferrum.engine.core_messages import SchedulerStats
from ferrum.entrypoints.openai.metrics import request_finish_reason
from ferrum.logger import init_logger
from ferrum.outputs import RequestOutput

logger = init_logger(__name__)


class StatsLogger:
    """Throughputs from the engine's counters between two lines: tokens computed per step
    (`iteration_tokens_sum`) split into prompt tokens (those looked up in the prefix cache, the
    cached ones included, as vLLM counts them) and the rest, generated tokens. Without prefix
    caching the split is unknown and the line gives their sum."""

    def __init__(self, engine: AsyncLLM, prefix_caching: bool) -> None:
        self.engine = engine
        self.prefix_caching = prefix_caching
        self.last: SchedulerStats | None = None
        self.last_time = time.monotonic()

    def line(self, stats: SchedulerStats | None, now: float) -> str | None:
        """The stats line since the previous call (None when the engine was and is idle)."""
        last, elapsed = self.last, max(now - self.last_time, 1e-9)
        self.last, self.last_time = stats, now
        if stats is None:
            return None
        tokens = stats.iteration_tokens_sum - (last.iteration_tokens_sum if last else 0)
        queries = stats.prefix_cache_queries - (last.prefix_cache_queries if last else 0)
        hits = stats.prefix_cache_hits - (last.prefix_cache_hits if last else 0)
        if tokens == 0 and stats.num_running == 0 and stats.num_waiting == 0:
            return None
        if self.prefix_caching:
            generated = max(tokens - (queries - hits), 0)
            throughput = (
                f"Avg prompt throughput: {queries / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {generated / elapsed:.1f} tokens/s"
            )
        else:
            throughput = f"Avg throughput (prompt + generation): {tokens / elapsed:.1f} tokens/s"
        hit_rate = stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1)
        return (
            f"{throughput}, Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {stats.kv_cache_usage * 100:.1f}%, "
            f"Prefix cache hit rate: {hit_rate * 100:.1f}%"
        )

    async def run(self, interval: float) -> None:
        """Logs a line every `interval` seconds while there is something to say; until cancelled."""
        while True:
            await asyncio.sleep(interval)
            text = self.line(self.engine.stats(), time.monotonic())
            if text is not None:
                logger.info("%s", text)


def start_stats_logging(engine: AsyncLLM, disable_log_stats: bool) -> asyncio.Task | None:
    """The periodic stats task (None with --disable-log-stats); with DEBUG on, also a line per
    finished request."""
    if logger.isEnabledFor(logging.DEBUG):
        engine.add_finished_listener(log_finished_request)
    if disable_log_stats:
        return None
    prefix_caching = engine.config.cache_config.enable_prefix_caching
    stats_logger = StatsLogger(engine, prefix_caching)
    return asyncio.create_task(stats_logger.run(envs.log_stats_interval()))


def log_finished_request(output: RequestOutput) -> None:
    """DEBUG: a finished (or aborted) request's id, token counts, reason and latency."""
    metrics = output.metrics
    generated = sum(len(c.token_ids) for c in output.outputs)
    if metrics is not None and metrics.num_generation_tokens:
        generated = sum(metrics.num_generation_tokens)
    latency = ""
    if metrics is not None and metrics.finished_time is not None:
        latency = f", {metrics.finished_time - metrics.arrival_time:.3f} s"
    logger.debug(
        "finished request %s: %d prompt tokens (%d cached), %d generated, %s%s",
        output.request_id,
        len(output.prompt_token_ids),
        output.num_cached_tokens,
        generated,
        request_finish_reason(output),
        latency,
    )
