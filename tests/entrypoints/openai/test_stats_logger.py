"""The server's periodic stats line and its per-request lines, from engine stats alone."""

from __future__ import annotations

import logging

import pytest
from pydantic import BaseModel

from ferrum.engine.core_messages import SchedulerStats
from ferrum.entrypoints.openai.http_errors import APIError
from ferrum.entrypoints.openai.request_log import RequestLog
from ferrum.entrypoints.openai.stats_logger import StatsLogger, log_finished_request
from ferrum.outputs import CompletionOutput, RequestMetrics, RequestOutput


def _stats(tokens: int, queries: int, hits: int, running: int = 1) -> SchedulerStats:
    return SchedulerStats(
        num_running=running,
        num_waiting=2,
        kv_cache_usage=0.25,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        num_preemptions=0,
        iteration_tokens_sum=tokens,
    )


def test_the_line_splits_prompt_and_generated_tokens() -> None:
    stats_logger = StatsLogger(engine=None, prefix_caching=True)  # type: ignore[arg-type]
    stats_logger.last_time = 0.0
    # 100 prompt tokens looked up (40 cached: 60 computed) and 140 tokens computed in 10 s.
    line = stats_logger.line(_stats(140, 100, 40), 10.0)
    assert line == (
        "Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 8.0 tokens/s, "
        "Running: 1 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 40.0%"
    )
    line = stats_logger.line(_stats(160, 100, 40), 20.0)  # then 20 decodes
    assert line is not None and line.startswith(
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 2.0 tokens/s"
    )
    idle = _stats(160, 100, 40, running=0)
    idle.num_waiting = 0
    assert stats_logger.line(idle, 30.0) is None  # nothing to say
    assert stats_logger.line(None, 40.0) is None  # before the first step


def test_without_prefix_caching_the_line_gives_the_sum() -> None:
    stats_logger = StatsLogger(engine=None, prefix_caching=False)  # type: ignore[arg-type]
    stats_logger.last_time = 0.0
    line = stats_logger.line(_stats(50, 0, 0), 5.0)
    assert line is not None
    assert line.startswith("Avg throughput (prompt + generation): 10.0 tokens/s, Running: 1")


def test_finished_request_debug_line(caplog: pytest.LogCaptureFixture) -> None:
    output = RequestOutput(
        "cmpl-1",
        None,
        [1, 2, 3],
        [CompletionOutput(0, "ab", [5, 6], finish_reason="length")],
        True,
        num_cached_tokens=2,
        metrics=RequestMetrics(arrival_time=1.0, finished_time=1.5, num_generation_tokens=[2]),
    )
    with caplog.at_level(logging.DEBUG, logger="ferrum"):
        log_finished_request(output)
    assert caplog.messages == [
        "finished request cmpl-1: 3 prompt tokens (2 cached), 2 generated, length, 0.500 s"
    ]


class _Body(BaseModel):
    prompt: str = ""
    logprobs: int | bool | None = None
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None


def test_max_logprobs_is_a_400_naming_the_field(caplog: pytest.LogCaptureFixture) -> None:
    log = RequestLog(max_logprobs=2, enable_log_requests=True, max_log_len=20)
    log.admit("/v1/chat/completions", _Body(logprobs=True, top_logprobs=2))  # a bool is a switch
    for field in ("logprobs", "top_logprobs", "prompt_logprobs"):
        with pytest.raises(APIError) as error:
            log.admit("/v1/completions", _Body(**{field: 3}))
        assert error.value.status_code == 400 and error.value.info.param == field
        assert error.value.info.message == (
            f"{field}: 3 exceeds this server's max_logprobs=2 (--max-logprobs)"
        )
    caplog.clear()
    log.admit("/v1/completions", _Body(prompt="x" * 50))
    (message,) = caplog.messages
    assert message == 'request to /v1/completions: {"prompt": "xxxxxxxx... (64 characters)'
