"""Batch invariance on the GPU at real model shapes (runs only with CUDA): Qwen3-0.6B and Qwen3-8B
shapes with random weights (`load_format="dummy"`), bf16 and FP8 (quantized at load). 8 probes,
64 greedy tokens with logprobs, each alone; then among 56 other prompts in one call (chunked
differently: a 1,024-token budget), after prefix-cache hits, and on a small KV pool with a
256-token budget where requests are preempted and recomputed; and eager (no CUDA graphs) against
graphs. Tokens and logprobs bitwise equal."""

from __future__ import annotations

import gc
import random
from pathlib import Path

import pytest
import torch

from ferrum import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MODELS = Path(__file__).resolve().parents[2] / "benchmarks" / "models"
PROBE_LENGTHS = [37, 120, 300, 640, 1100, 75, 900, 1500]
PARAMS = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=1)


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 100_000) for _ in range(n)] for n in lengths]


PROBES = prompts(PROBE_LENGTHS, seed=1)
OTHERS = prompts([random.Random(2).randrange(20, 1200) for _ in range(56)], seed=3)


def engine(model: str, quantization: str | None, **kwargs: object) -> LLM:
    return LLM(
        str(MODELS / model), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
        quantization=quantization, max_model_len=4096, batch_invariant=True, **kwargs,
    )  # fmt: skip


def results(llm: LLM, batch: list[list[int]]) -> list[tuple[list[int], list[object]]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def probes_in_a_batch(llm: LLM) -> list[tuple[list[int], list[object]]]:
    mixed = OTHERS[:20] + PROBES[:4] + OTHERS[20:40] + PROBES[4:] + OTHERS[40:]
    got = results(llm, mixed)
    return [got[mixed.index(p)] for p in PROBES]


def drop(llm: LLM) -> None:
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("quantization", [None, "fp8"], ids=["bf16", "fp8"])
@pytest.mark.parametrize("model", ["qwen3-0.6b", "qwen3-8b"])
def test_probes_are_bitwise_equal_in_every_batch(model: str, quantization: str | None) -> None:
    llm = engine(model, quantization, kv_cache_memory_bytes=8 << 30, max_num_batched_tokens=1024)
    alone = [results(llm, [p])[0] for p in PROBES]
    batched = probes_in_a_batch(llm)
    # Prompts sharing each probe's first 256 tokens (block-aligned) fill the prefix cache.
    results(llm, [p[:256] + o[:40] for p, o in zip(PROBES, OTHERS)])
    hits_before = llm.llm_engine.stats().prefix_cache_hits
    after_hits = [results(llm, [p])[0] for p in PROBES]
    assert llm.llm_engine.stats().prefix_cache_hits > hits_before
    drop(llm)
    tight = engine(model, quantization, kv_cache_memory_bytes=1 << 30, max_num_batched_tokens=256)
    preempted = probes_in_a_batch(tight)
    assert tight.llm_engine.stats().num_preemptions > 0
    drop(tight)
    for name, got in (("batch", batched), ("prefix hit", after_hits), ("preempted", preempted)):
        equal = sum(g == a for g, a in zip(got, alone))
        assert equal == len(PROBES), f"{name}: {equal}/{len(PROBES)} probes equal to alone"


def test_eager_equals_cuda_graphs() -> None:
    graphs = engine("qwen3-0.6b", None, kv_cache_memory_bytes=4 << 30)
    expected = probes_in_a_batch(graphs)
    drop(graphs)
    eager = engine("qwen3-0.6b", None, kv_cache_memory_bytes=4 << 30, enforce_eager=True)
    assert probes_in_a_batch(eager) == expected
    drop(eager)
