"""Scheduler stats of a front end whose engine core may be replaced: counters add up over
every core it ran; gauges are the current core's, or 0 while none is serving. Data-parallel
replicas add up into one engine's stats (`sum_replica_stats`)."""

from __future__ import annotations

import dataclasses

from ferrum.engine.core_messages import SchedulerStats


class StatsAcrossCores:
    def __init__(self) -> None:
        self._latest: SchedulerStats | None = None
        # Counters of the cores that are gone.
        self._past = SchedulerStats(0, 0, 0.0, 0, 0, 0)

    def update(self, stats: SchedulerStats) -> None:
        """The current core's stats after its latest step."""
        self._latest = stats

    def retire_core(self) -> None:
        """The current core is gone: its counters move to the past."""
        latest, past = self._latest, self._past
        if latest is None:
            return
        self._past = _with_counters(past, past, latest)
        self._latest = SchedulerStats(0, 0, 0.0, 0, 0, 0)

    def current(self, serving: bool) -> SchedulerStats | None:
        """Counters summed over every core; the gauges only while a core is `serving`. None
        before the first core's first step."""
        latest, past = self._latest, self._past
        if latest is None:
            return None
        gauges = latest if serving else SchedulerStats(0, 0, 0.0, 0, 0, 0)
        return _with_counters(gauges, past, latest)


def _with_counters(gauges: SchedulerStats, a: SchedulerStats, b: SchedulerStats) -> SchedulerStats:
    """`gauges` with the counters of `a` and `b` added up."""
    return dataclasses.replace(
        gauges,
        prefix_cache_queries=a.prefix_cache_queries + b.prefix_cache_queries,
        prefix_cache_hits=a.prefix_cache_hits + b.prefix_cache_hits,
        num_preemptions=a.num_preemptions + b.num_preemptions,
        iteration_tokens_counts=_add(a.iteration_tokens_counts, b.iteration_tokens_counts),
        iteration_tokens_sum=a.iteration_tokens_sum + b.iteration_tokens_sum,
        spec_num_drafts=a.spec_num_drafts + b.spec_num_drafts,
        spec_num_draft_tokens=a.spec_num_draft_tokens + b.spec_num_draft_tokens,
        spec_num_accepted_tokens=a.spec_num_accepted_tokens + b.spec_num_accepted_tokens,
        spec_accepted_per_position=_add(a.spec_accepted_per_position, b.spec_accepted_per_position),
    )


def _add(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """Element-wise sum; the shorter tuple counts as zeros past its end."""
    if len(a) < len(b):
        a, b = b, a
    return tuple(x + (b[i] if i < len(b) else 0) for i, x in enumerate(a))


def sum_replica_stats(
    stats: list[SchedulerStats | None], num_kv_blocks: list[int]
) -> SchedulerStats | None:
    """Stats of data-parallel replicas as one engine: requests and counters add up; KV cache
    usage is the used fraction of all their blocks (`num_kv_blocks[i]`: replica i's pool).
    A replica with no stats yet counts as idle; None while none has any."""
    known = [(s, n) for s, n in zip(stats, num_kv_blocks) if s is not None]
    if not known:
        return None
    total = SchedulerStats(0, 0, 0.0, 0, 0, 0)
    for replica_stats, _ in known:
        total = _with_counters(total, total, replica_stats)
        total.num_running += replica_stats.num_running
        total.num_waiting += replica_stats.num_waiting
    num_blocks = sum(num_kv_blocks)
    if num_blocks > 0:
        total.kv_cache_usage = sum(s.kv_cache_usage * n for s, n in known) / num_blocks
    return total
