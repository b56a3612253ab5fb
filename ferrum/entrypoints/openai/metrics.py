"""GET /metrics: vLLM's Prometheus metric set under `ferrum:`, in the server's own registry.
Scheduler gauges, prefix-cache counters and the tokens-per-step histogram come from each core's
latest stats at scrape time, labelled `engine` (the data-parallel replica); per-request metrics are
updated once per request as it finishes. Times are time.monotonic(): queue time from arrival in
the API process to first scheduling, prefill to the first token, decode from there to the last."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ferrum.engine.async_llm import AsyncLLM
from ferrum.engine.core_messages import ITERATION_TOKENS_BUCKETS, SchedulerStats
from ferrum.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)


class _EngineStatsCollector(Collector):
    def __init__(self, engine: AsyncLLM, model_name: str, max_loras: int | None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_loras = max_loras

    def collect(self) -> Iterator[Metric]:
        """One sample per engine core (label `engine`: the data-parallel replica index); the
        engine's totals are their sum (KV usage: each core's own pool)."""
        replicas = [(str(i), s) for i, s in enumerate(self.engine.replica_stats())]
        labels = ["model_name", "engine"]

        def family(kind: type, name: str, doc: str, value: Callable[[SchedulerStats], float]):
            metric = kind(name, doc, labels=labels)
            for engine, stats in replicas:
                metric.add_metric([self.model_name, engine], value(stats) if stats else 0)
            return metric

        yield family(
            GaugeMetricFamily,
            "ferrum:num_requests_running",
            "Requests in the running batch",
            lambda s: s.num_running,
        )
        yield family(
            GaugeMetricFamily,
            "ferrum:num_requests_waiting",
            "Requests waiting to be scheduled",
            lambda s: s.num_waiting,
        )
        yield family(
            GaugeMetricFamily,
            "ferrum:kv_cache_usage_perc",
            "Fraction of KV cache blocks in use (1 = full)",
            lambda s: s.kv_cache_usage,
        )
        yield family(
            CounterMetricFamily,
            "ferrum:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            lambda s: s.prefix_cache_queries,
        )
        yield family(
            CounterMetricFamily,
            "ferrum:prefix_cache_hits",
            "Prompt tokens served from the prefix cache",
            lambda s: s.prefix_cache_hits,
        )
        yield family(
            CounterMetricFamily,
            "ferrum:num_preemptions",
            "Requests preempted to free KV cache blocks",
            lambda s: s.num_preemptions,
        )
        yield from _spec_decode_families(family, replicas, self.model_name)
        if self.max_loras is not None:
            yield _lora_info(replicas, self.max_loras)
        iteration_tokens = HistogramMetricFamily(
            "ferrum:iteration_tokens_total",
            "Tokens (prompt and generated) per engine step",
            labels=labels,
        )
        bounds = [str(float(b)) for b in ITERATION_TOKENS_BUCKETS] + ["+Inf"]
        for engine, stats in replicas:
            counts = stats.iteration_tokens_counts if stats else ()
            counts = counts or (0,) * len(bounds)
            cumulative, buckets = 0, []
            for bound, count in zip(bounds, counts):
                cumulative += count
                buckets.append((bound, cumulative))
            total = stats.iteration_tokens_sum if stats else 0
            iteration_tokens.add_metric([self.model_name, engine], buckets, total)
        yield iteration_tokens

    def describe(self) -> Iterator[Metric]:
        return iter(())


def _spec_decode_families(
    family: Callable[..., Metric], replicas: list[tuple[str, SchedulerStats | None]], model: str
) -> Iterator[Metric]:
    """vLLM's spec_decode counters: drafts verified, draft tokens, accepted tokens (in all, and
    by draft position)."""
    yield family(
        CounterMetricFamily,
        "ferrum:spec_decode_num_drafts",
        "Drafts verified (one per request and step that had drafts)",
        lambda s: s.spec_num_drafts,
    )
    yield family(
        CounterMetricFamily,
        "ferrum:spec_decode_num_draft_tokens",
        "Draft tokens verified",
        lambda s: s.spec_num_draft_tokens,
    )
    yield family(
        CounterMetricFamily,
        "ferrum:spec_decode_num_accepted_tokens",
        "Draft tokens accepted",
        lambda s: s.spec_num_accepted_tokens,
    )
    per_position = CounterMetricFamily(
        "ferrum:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft",
        labels=["model_name", "engine", "position"],
    )
    for engine, stats in replicas:
        for position, count in enumerate(stats.spec_accepted_per_position if stats else ()):
            per_position.add_metric([model, engine, str(position)], count)
    yield per_position


def _lora_info(replicas: list[tuple[str, SchedulerStats | None]], max_loras: int) -> Metric:
    """vLLM's lora_requests_info: the adapters in use as labels (comma-separated names), the
    scrape's wall time as the value."""
    info = GaugeMetricFamily(
        "ferrum:lora_requests_info",
        "LoRA adapters of the running and waiting requests",
        labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters", "engine"],
    )
    now = time.time()
    for engine, stats in replicas:
        running = ",".join(stats.running_lora_adapters) if stats else ""
        waiting = ",".join(stats.waiting_lora_adapters) if stats else ""
        info.add_metric([str(max_loras), running, waiting, engine], now)
    return info


class ServerMetrics:
    def __init__(self, engine: AsyncLLM, model_name: str, max_loras: int | None = None) -> None:
        """`max_loras`: the engine's, with LoRA on (None: no `lora_requests_info`)."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(_EngineStatsCollector(engine, model_name, max_loras))
        labels = ["model_name"]
        self.time_to_first_token = Histogram(
            "ferrum:time_to_first_token_seconds",
            "Time from arrival to the first generated token",
            labels,
            registry=self.registry,
            buckets=_LATENCY_BUCKETS,
        ).labels(model_name)
        self.time_per_output_token = Histogram(
            "ferrum:time_per_output_token_seconds",
            "Mean time between generated tokens after the first, per request",
            labels,
            registry=self.registry,
            buckets=_LATENCY_BUCKETS,
        ).labels(model_name)
        self.inter_token_latency = self._histogram(
            "ferrum:inter_token_latency_seconds",
            "Time between consecutive outputs of new tokens of one completion",
            _LATENCY_BUCKETS,
        )
        self.queue_time = self._histogram(
            "ferrum:request_queue_time_seconds",
            "Time from arrival to the first scheduling by the engine core",
            _E2E_BUCKETS,
        )
        self.prefill_time = self._histogram(
            "ferrum:request_prefill_time_seconds",
            "Time from the first scheduling to the first generated token",
            _E2E_BUCKETS,
        )
        self.decode_time = self._histogram(
            "ferrum:request_decode_time_seconds",
            "Time from the first generated token to the last",
            _E2E_BUCKETS,
        )
        self.inference_time = self._histogram(
            "ferrum:request_inference_time_seconds",
            "Time from the first scheduling to the last generated token",
            _E2E_BUCKETS,
        )
        self.e2e_latency = Histogram(
            "ferrum:e2e_request_latency_seconds",
            "Time from arrival to the end of the request",
            labels,
            registry=self.registry,
            buckets=_E2E_BUCKETS,
        ).labels(model_name)
        self.prompt_tokens = Counter(
            "ferrum:prompt_tokens",
            "Prompt tokens of finished requests",
            labels,
            registry=self.registry,
        ).labels(model_name)
        self.generation_tokens = Counter(
            "ferrum:generation_tokens",
            "Generated tokens of finished requests",
            labels,
            registry=self.registry,
        ).labels(model_name)
        self.request_success = Counter(
            "ferrum:request_success",
            "Finished requests by finish reason (one per request, whatever its n)",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        engine.add_finished_listener(self.observe_finished)

    def _histogram(self, name: str, documentation: str, buckets: tuple[float, ...]) -> Any:
        return Histogram(
            name, documentation, ["model_name"], registry=self.registry, buckets=buckets
        ).labels(self.model_name)

    def observe_finished(self, output: RequestOutput) -> None:
        """`output`: the request's final output, cumulative or DELTA; observed once per request."""
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.request_success.labels(self.model_name, request_finish_reason(output)).inc()
        metrics = output.metrics
        if metrics is None or metrics.finished_time is None:
            return
        self.generation_tokens.inc(sum(metrics.num_generation_tokens))
        self.e2e_latency.observe(metrics.finished_time - metrics.arrival_time)
        for latency in metrics.inter_token_latencies:
            self.inter_token_latency.observe(latency)
        scheduled = metrics.first_scheduled_time
        if scheduled is not None:
            self.queue_time.observe(max(scheduled - metrics.arrival_time, 0.0))
        if metrics.first_token_time is None or metrics.last_token_time is None:
            return
        self.time_to_first_token.observe(metrics.first_token_time - metrics.arrival_time)
        self.decode_time.observe(metrics.last_token_time - metrics.first_token_time)
        if scheduled is not None:
            self.prefill_time.observe(max(metrics.first_token_time - scheduled, 0.0))
            self.inference_time.observe(max(metrics.last_token_time - scheduled, 0.0))
        num_tokens = max(metrics.num_generation_tokens, default=0)
        if num_tokens > 1:
            self.time_per_output_token.observe(
                (metrics.finished_time - metrics.first_token_time) / (num_tokens - 1)
            )

    def render(self) -> bytes:
        return generate_latest(self.registry)


def request_finish_reason(output: RequestOutput) -> str:
    """One reason per request: "abort" if any completion was aborted, else the first one's."""
    reasons = [c.finish_reason or "abort" for c in output.outputs]
    return "abort" if "abort" in reasons else reasons[0] if reasons else "abort"
