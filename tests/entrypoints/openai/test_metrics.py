"""The server's Prometheus metrics: one count per request whatever its n, and the timeline
histograms from a request's RequestMetrics; the tokens-per-step histogram from the core's stats."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from ferrum.engine.core_messages import ITERATION_TOKENS_BUCKETS, SchedulerStats
from ferrum.entrypoints.openai.metrics import ServerMetrics
from ferrum.outputs import CompletionOutput, RequestMetrics, RequestOutput


class FakeEngine:
    def __init__(self, *replica_stats: SchedulerStats | None) -> None:
        self._stats = list(replica_stats)
        self.listeners: list[Callable[[RequestOutput], None]] = []

    def replica_stats(self) -> list[SchedulerStats | None]:
        return self._stats

    def add_finished_listener(self, listener: Callable[[RequestOutput], None]) -> None:
        self.listeners.append(listener)


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def finished_output(reasons: list[str], num_tokens: int) -> RequestOutput:
    metrics = RequestMetrics(
        arrival_time=10.0,
        first_scheduled_time=10.5,
        first_token_time=11.0,
        last_token_time=13.0,
        finished_time=13.0,
        num_generation_tokens=[num_tokens] * len(reasons),
        inter_token_latencies=[1.0] * (num_tokens - 1) * len(reasons),
    )
    completions = [
        CompletionOutput(i, "x", [1] * num_tokens, finish_reason=r) for i, r in enumerate(reasons)
    ]
    return RequestOutput("r", "p", [1, 2, 3], completions, True, metrics=metrics)


def test_one_success_per_request_and_the_timeline_histograms() -> None:
    engine = FakeEngine(None)
    metrics = ServerMetrics(engine, "m")  # type: ignore[arg-type]
    engine.listeners[0](finished_output(["length", "stop"], num_tokens=3))
    engine.listeners[0](finished_output(["stop", "abort"], num_tokens=3))
    values = samples(metrics)
    assert values[("ferrum:request_success_total", (("finished_reason", "length"),))] == 1
    assert values[("ferrum:request_success_total", (("finished_reason", "abort"),))] == 1
    assert ("ferrum:request_success_total", (("finished_reason", "stop"),)) not in values
    assert values[("ferrum:e2e_request_latency_seconds_count", ())] == 2
    assert values[("ferrum:inter_token_latency_seconds_count", ())] == 8
    for name, seconds in (
        ("request_queue_time", 0.5),
        ("request_prefill_time", 0.5),
        ("request_decode_time", 2.0),
        ("request_inference_time", 2.5),
    ):
        assert values[(f"ferrum:{name}_seconds_count", ())] == 2
        assert values[(f"ferrum:{name}_seconds_sum", ())] == 2 * seconds
    assert values[("ferrum:generation_tokens_total", ())] == 12


def test_iteration_tokens_come_from_the_cores_counts() -> None:
    counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    counts[0], counts[3], counts[-1] = 5, 2, 1  # 5 steps of 1 token, 2 of 17-32, 1 above 16384
    stats = SchedulerStats(0, 0, 0.0, 0, 0, 0, tuple(counts), 5 + 50 + 20000)
    values = samples(ServerMetrics(FakeEngine(stats), "m"))  # type: ignore[arg-type]
    bucket = "ferrum:iteration_tokens_total_bucket"
    assert values[(bucket, (("engine", "0"), ("le", "1.0")))] == 5
    assert values[(bucket, (("engine", "0"), ("le", "16.0")))] == 5
    assert values[(bucket, (("engine", "0"), ("le", "32.0")))] == 7
    assert values[(bucket, (("engine", "0"), ("le", "+Inf")))] == 8
    assert values[("ferrum:iteration_tokens_total_sum", (("engine", "0"),))] == 20055


def test_each_data_parallel_replica_is_an_engine_label() -> None:
    counts = (1,) + (0,) * len(ITERATION_TOKENS_BUCKETS)
    first = SchedulerStats(2, 1, 0.5, 10, 4, 0, counts, 1)
    second = SchedulerStats(0, 3, 0.25, 20, 8, 1, counts, 1)
    values = samples(ServerMetrics(FakeEngine(first, second, None), "m"))  # type: ignore[arg-type]
    for name, want in (
        ("ferrum:num_requests_running", [2, 0, 0]),
        ("ferrum:num_requests_waiting", [1, 3, 0]),
        ("ferrum:kv_cache_usage_perc", [0.5, 0.25, 0]),
        ("ferrum:prefix_cache_hits_total", [4, 8, 0]),
        ("ferrum:num_preemptions_total", [0, 1, 0]),
        ("ferrum:iteration_tokens_total_count", [1, 1, 0]),
    ):
        assert [values[(name, (("engine", str(i)),))] for i in range(3)] == want, name


def test_spec_decode_counters_come_from_the_cores_stats() -> None:
    stats = SchedulerStats(0, 0, 0.0, 0, 0, 0, (), 0, 7, 20, 11, (6, 4, 1))
    values = samples(ServerMetrics(FakeEngine(stats, None), "m"))  # type: ignore[arg-type]
    engine = (("engine", "0"),)
    assert values[("ferrum:spec_decode_num_drafts_total", engine)] == 7
    assert values[("ferrum:spec_decode_num_draft_tokens_total", engine)] == 20
    assert values[("ferrum:spec_decode_num_accepted_tokens_total", engine)] == 11
    per_position = "ferrum:spec_decode_num_accepted_tokens_per_pos_total"
    assert [values[(per_position, engine + (("position", str(p)),))] for p in range(3)] == [6, 4, 1]
    assert values[("ferrum:spec_decode_num_drafts_total", (("engine", "1"),))] == 0
