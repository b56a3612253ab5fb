"""A `Scheduler` over a small KV pool, and the model runner's side of its steps, played by hand.

Blocks hold BLOCK tokens. `run_step` is a synchronous step; `launch` + `complete` split one so
that further steps can be scheduled while it is in flight (async scheduling).
"""

from __future__ import annotations

from ferrum.config import SchedulerConfig
from ferrum.kv.kv_cache_manager import KVCacheManager
from ferrum.request import Request
from ferrum.sampling_params import SamplingParams
from ferrum.scheduler.output import ModelRunnerOutput, SchedulerOutput
from ferrum.scheduler.scheduler import RequestUpdate, Scheduler

BLOCK = 4


def make_scheduler(
    num_blocks: int = 64,
    budget: int = 64,
    max_seqs: int = 16,
    max_len: int = 256,
    caching=True,
    pipeline_depth: int = 1,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=caching)
    config = SchedulerConfig(
        max_model_len=max_len, max_num_seqs=max_seqs, max_num_batched_tokens=budget
    )
    return Scheduler(config, kv, pipeline_depth=pipeline_depth)


def make_request(
    req_id: str, num_prompt: int, max_tokens: int = 8, start: int = 0, eos: int | None = None, **kw
) -> Request:
    """Prompt `start, start + 1, ...` of `num_prompt` tokens, greedy."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw).resolve()
    return Request(req_id, list(range(start, start + num_prompt)), params, eos_token_id=eos)


def launch(scheduler: Scheduler) -> tuple[SchedulerOutput, list[str]]:
    """Schedules one step; returns it and the requests it samples a token for, in batch order."""
    before = {req_id: r.num_output_placeholders for req_id, r in scheduler.requests.items()}
    out = scheduler.schedule()
    sampled = [
        req_id
        for req_id in out.num_scheduled_tokens
        if scheduler.requests[req_id].num_output_placeholders > before[req_id]
    ]
    return out, sampled


def complete(
    scheduler: Scheduler, out: SchedulerOutput, req_ids: list[str], tokens: list[int]
) -> list[RequestUpdate]:
    """Answers a launched step like the runner: `tokens[i]` sampled for `req_ids[i]`."""
    return scheduler.update_from_output(out, ModelRunnerOutput(req_ids, tokens))


def run_step(scheduler: Scheduler, token: int = 1000) -> tuple[SchedulerOutput, list]:
    """Schedules one step and answers it at once: `token` for each request that caught up."""
    out, sampled = launch(scheduler)
    return out, complete(scheduler, out, sampled, [token] * len(sampled))
