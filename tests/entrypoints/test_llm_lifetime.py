"""A dropped or shut-down `LLM` gives back what it holds: its model and KV cache (memory),
its worker processes (tensor parallelism, `mp`) and its engine-core processes (data
parallelism), once it is collected (`shutdown()` stops them at once: tested with each)."""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path

import pytest

from tests.utils.processes import descendant_pids, wait_gone
from tests.utils.tiny_llm import greedy, make_llm, random_prompts

ENGINE = dict(num_kv_blocks=24, max_num_seqs=4, num_cpu_threads=1)
PROMPTS = random_prompts([6], seed=4)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> str:  # noqa: ANN001 - the session factory
    return tiny_checkpoint("qwen3")


def test_a_dropped_engine_frees_its_model_and_cache(checkpoint: str) -> None:
    llm = make_llm(checkpoint, **ENGINE)
    greedy(llm, PROMPTS)
    runner = llm.llm_engine.core.executor.runner
    cache = next(
        m.kv_cache for m in runner.model.modules() if getattr(m, "kv_cache", None) is not None
    )
    model, caches = weakref.ref(runner.model), weakref.ref(cache)
    del llm, runner, cache
    gc.collect()
    assert model() is None and caches() is None


@pytest.mark.parametrize(
    "parallel", [dict(tensor_parallel_size=2), dict(data_parallel_size=2)], ids=["tp", "dp"]
)
def test_a_dropped_engine_leaves_no_process_behind(checkpoint: str, parallel: dict) -> None:
    before = set(descendant_pids(os.getpid()))
    llm = make_llm(checkpoint, **ENGINE, **parallel)
    greedy(llm, PROMPTS)
    # multiprocessing's resource tracker outlives every engine: it serves the whole process.
    started = [
        pid
        for pid in sorted(set(descendant_pids(os.getpid())) - before)
        if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert started, "the engine runs processes of its own"
    del llm
    gc.collect()
    wait_gone(started)
