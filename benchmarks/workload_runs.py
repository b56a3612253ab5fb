"""The workloads run_workloads.py runs (BENCHMARKS.md's `lat`, `c16`, `c64`, `nano`, and
`prefix`, `long`, `decode8k`, `turn16`, `turn64`), each on a started `LLM`, returning its figures;
seeds and sizes of every prompt set, so that no two workloads share a prompt prefix unless stated.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.dummy_engine import start_decoding
from ferrum.bench import workloads
from ferrum.bench.latency import (
    TTFT_SEED_OFFSET,
    measure_latencies,
    median,
    timed_generate,
)
from ferrum.bench.throughput import measure_throughput
from ferrum.entrypoints.llm import LLM
from ferrum.sampling_params import SamplingParams

LONG_PROMPTS, LONG_INPUT_LEN, LONG_OUTPUT_LEN = 32, 4000, 128
DECODE_CTX_PROMPTS, DECODE_CTX_LEN, DECODE_CTX_STEPS = 32, 8000, 128
# `prefix`: a shared prefix of this many tokens, then a suffix of PREFIX_SUFFIX_LEN.
PREFIX_LEN = 2000
PREFIX_SUFFIX_LEN = 16
PREFIX_SEED_BASE = 9000
# Timed `lat` prompts use seeds 1, 2, ...: lat_prompt(0) is the prefix of the c16/c64 prompt 0.
LAT_SEED_BASE = 1
# The throughput warm-up batch: its own seed, so it shares no prefix with a timed prompt.
WARMUP_SEED = 424242
# Prompts of `--repeats` repeat r > 0 of throughput workload i: recipe seed REPEAT_SEED_BASE +
# 1000 * i + r, far from every other seed here, so that no repeat shares a prompt prefix with
# another workload's or repeat's prompts (repeat 0 keeps the BENCHMARKS.md seeds below).
REPEAT_SEED_BASE = 500_000
THROUGHPUT_SEEDS = {"c16": 0, "c64": 0, "nano": 0, "long": 7}
# The next turn of many conversations: (conversations, cached tokens each, new tokens, output
# tokens). turn16: long chat turns; turn64: an agent loop's next step (a tool result).
TURNS = {"turn16": (16, 6000, 1500, 64), "turn64": (64, 3000, 300, 32)}
TURN_SEED_BASE = 700_000
WARMUP_OUTPUT_LEN = 8
C_TEMPERATURE = 1.0
NANO_TEMPERATURE = 0.6


def run_lat(
    llm: LLM, vocab_size: int, scale: float, num_warmup: int, num_iters: int
) -> dict[str, Any]:
    """TTFT = median time of a max_tokens=1 request; TPOT = (t(513) - t(1)) / 512 (medians)."""
    input_len = scaled(128, scale)
    decode_len = scaled(512, scale)
    greedy = {"temperature": 0.0, "ignore_eos": True}

    def prompts_for(seed: int) -> list[list[int]]:
        prompt = workloads.lat_prompt(seed=LAT_SEED_BASE + seed, n_in=input_len)
        return workloads.fold_to_vocab([prompt], vocab_size)

    first_times = measure_latencies(
        llm,
        lambda seed: prompts_for(TTFT_SEED_OFFSET + seed),
        SamplingParams(max_tokens=1, **greedy),
        num_warmup,
        num_iters,
    )
    full_times = measure_latencies(
        llm, prompts_for, SamplingParams(max_tokens=decode_len + 1, **greedy), num_warmup, num_iters
    )
    ttft = median(first_times)
    tpot = (median(full_times) - ttft) / decode_len
    return {
        "input_len": input_len,
        "output_len": decode_len + 1,
        "num_warmup": num_warmup,
        "num_iters": num_iters,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "ttft_ms": ttft * 1e3,
        "tpot_ms": tpot * 1e3,
        "t_first_s": first_times,
        "t_full_s": full_times,
    }


def run_prefix(
    llm: LLM, vocab_size: int, scale: float, num_warmup: int, num_iters: int
) -> dict[str, Any]:
    """Prefix-cache TTFT: per iteration a fresh PREFIX_LEN-token prefix, first with one suffix
    (cold: nothing cached) then with another (hit: the prefix comes from the cache), one
    max_tokens=1 request each; medians of each, and the tokens the hits served."""
    prefix_len, suffix_len = scaled(PREFIX_LEN, scale), max(1, scaled(PREFIX_SUFFIX_LEN, scale))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def pair(seed: int) -> tuple[list[int], list[int]]:
        tokens = workloads.lat_prompt(
            seed=PREFIX_SEED_BASE + seed, n_in=prefix_len + 2 * suffix_len
        )
        prefix, a, b = tokens[:prefix_len], tokens[prefix_len:-suffix_len], tokens[-suffix_len:]
        cold, hit = workloads.fold_to_vocab([prefix + a, prefix + b], vocab_size)
        return cold, hit

    for i in range(num_warmup):
        for prompt in pair(10_000 + i):
            timed_generate(llm, [prompt], params)
    cold_times, hit_times, cached = [], [], []
    for i in range(num_iters):
        cold, hit = pair(i)
        cold_times.append(timed_generate(llm, [cold], params)[0])
        seconds, outputs = timed_generate(llm, [hit], params)
        hit_times.append(seconds)
        cached.append(outputs[0].num_cached_tokens)
    cold_ttft, hit_ttft = median(cold_times), median(hit_times)
    return {
        "prefix_len": prefix_len,
        "suffix_len": suffix_len,
        "num_iters": num_iters,
        "cold_ttft_ms": cold_ttft * 1e3,
        "hit_ttft_ms": hit_ttft * 1e3,
        "speedup": cold_ttft / hit_ttft,
        "num_cached_tokens": cached,
        "t_cold_s": cold_times,
        "t_hit_s": hit_times,
    }


def run_throughput(
    llm: LLM, name: str, vocab_size: int, scale: float, engine_seed: int, repeat: int
) -> dict[str, Any]:
    """One run of the throughput workload `name` (c16, c64, nano or long), prompts of repeat
    `repeat` (0: the BENCHMARKS.md prompts; see REPEAT_SEED_BASE)."""
    seed = THROUGHPUT_SEEDS[name]
    if repeat:
        seed = REPEAT_SEED_BASE + 1000 * list(THROUGHPUT_SEEDS).index(name) + repeat
    if name == "nano":
        return run_nano(llm, vocab_size, scale, engine_seed, seed)
    if name == "long":
        return run_long(llm, vocab_size, scale, seed)
    return run_concurrent(llm, vocab_size, scale, scaled(int(name[1:]), scale), seed)


def run_turn(llm: LLM, name: str, vocab_size: int, scale: float, repeat: int) -> dict[str, Any]:
    """`turn16` / `turn64`: each conversation's history submitted once, untimed (max_tokens 1:
    its KV stays in the prefix cache), then every history plus its new tokens at once, timed;
    prompts of repeat `repeat` share nothing with another repeat's."""
    conversations, cached, new, out = TURNS[name]
    conversations, cached, new = (scaled(n, scale) for n in (conversations, cached, new))
    seed = TURN_SEED_BASE + 1000 * list(TURNS).index(name) + 10 * repeat
    history, _ = workloads.batch(conversations, cached, 1, seed=seed)
    turn, _ = workloads.batch(conversations, new, 1, seed=seed + 1)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    timed_generate(llm, workloads.fold_to_vocab(history, vocab_size), params)
    prompts = [h + t for h, t in zip(history, turn)]
    figures = _measure(llm, vocab_size, prompts, [scaled(out, scale)] * conversations, 0.0)
    return {"num_prompts": conversations, "cached_len": cached, "new_len": new, **figures}


def run_repeated(run: Callable[[int], dict[str, Any]], repeats: int) -> dict[str, Any]:
    """Repeat 0's figures; with repeats > 1 also every repeat's output tok/s and their median."""
    figures = run(0)
    if repeats > 1:
        rates = [figures["output_tokens_per_second"]]
        rates += [run(r)["output_tokens_per_second"] for r in range(1, repeats)]
        figures["repeats_output_tokens_per_second"] = rates
        figures["median_output_tokens_per_second"] = median(rates)
    return figures


def _measure(
    llm: LLM, vocab_size: int, prompts: list[list[int]], output_lens: list[int], temperature: float
) -> dict[str, Any]:
    """Every prompt (folded into the vocabulary) submitted at once: the throughput figures."""
    folded = workloads.fold_to_vocab(prompts, vocab_size)
    return measure_throughput(llm, folded, output_lens, temperature).to_dict()


def run_concurrent(
    llm: LLM, vocab_size: int, scale: float, num_prompts: int, seed: int
) -> dict[str, Any]:
    """`c16` / `c64`: every prompt submitted at once; output tokens / s."""
    input_len, output_len = scaled(256, scale), scaled(256, scale)
    prompts, output_lens = workloads.batch(num_prompts, input_len, output_len, seed=seed)
    return {
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "temperature": C_TEMPERATURE,
        **_measure(llm, vocab_size, prompts, output_lens, C_TEMPERATURE),
    }


def run_long(llm: LLM, vocab_size: int, scale: float, seed: int) -> dict[str, Any]:
    """`long`: 32 prompts of 4,000 tokens, 128 output tokens each, submitted at once."""
    num_prompts = scaled(LONG_PROMPTS, scale)
    input_len, output_len = scaled(LONG_INPUT_LEN, scale), scaled(LONG_OUTPUT_LEN, scale)
    prompts, output_lens = workloads.batch(num_prompts, input_len, output_len, seed=seed)
    figures = _measure(llm, vocab_size, prompts, output_lens, C_TEMPERATURE)
    return {"num_prompts": num_prompts, "input_len": input_len, **figures}


def run_decode_at_context(llm: LLM, vocab_size: int, scale: float) -> dict[str, Any]:
    """`decode8k`: 32 prompts of 8,000 tokens brought to steady decode (every prompt prefilled),
    then 128 timed steps that each decode all 32: decode tok/s = 32 * 128 / their time."""
    num_prompts, input_len = scaled(DECODE_CTX_PROMPTS, scale), scaled(DECODE_CTX_LEN, scale)
    steps = scaled(DECODE_CTX_STEPS, scale)
    prompts, _ = workloads.batch(num_prompts, input_len, 1, seed=11)
    engine = llm.llm_engine
    # Room for the settle steps and the tokens in flight: no request ends inside the timing.
    req_ids = start_decoding(
        engine, workloads.fold_to_vocab(prompts, vocab_size), steps + 16, temperature=0.0
    )
    synchronize(llm)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    synchronize(llm)
    seconds = time.perf_counter() - start
    engine.abort_request(req_ids)
    return {
        "num_prompts": num_prompts,
        "context_len": input_len,
        "decode_steps": steps,
        "decode_tokens_per_second": num_prompts * steps / seconds,
        "decode_step_ms": seconds / steps * 1e3,
    }


def run_nano(
    llm: LLM, vocab_size: int, scale: float, engine_seed: int, seed: int
) -> dict[str, Any]:
    """`nano`: the seeded recipe at temperature 0.6 (sampling from the engine's seed); a seed
    other than 0 draws other prompts and lengths (`--repeats`)."""
    num_seqs = scaled(256, scale)
    max_in, max_out = max(100, scaled(1024, scale)), max(100, scaled(1024, scale))
    prompts, output_lens = workloads.nano(
        seed=seed, num_seqs=num_seqs, max_in=max_in, max_out=max_out
    )
    return {
        "num_prompts": num_seqs,
        "max_input_len": max_in,
        "max_output_len": max_out,
        "temperature": NANO_TEMPERATURE,
        "engine_seed": engine_seed,
        **_measure(llm, vocab_size, prompts, output_lens, NANO_TEMPERATURE),
    }


def throughput_warmup(llm: LLM, vocab_size: int, scale: float) -> float:
    """One short batch like c64: compiles the prefill and batched-decode paths untimed."""
    prompts, _ = workloads.batch(
        scaled(64, scale), scaled(256, scale), WARMUP_OUTPUT_LEN, seed=WARMUP_SEED
    )
    params = SamplingParams(
        temperature=C_TEMPERATURE, ignore_eos=True, max_tokens=WARMUP_OUTPUT_LEN
    )
    return timed_generate(llm, workloads.fold_to_vocab(prompts, vocab_size), params)[0]


def scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def synchronize(llm: LLM) -> None:
    if llm.llm_engine.config.device_config.device.startswith("cuda"):
        torch.cuda.synchronize()
