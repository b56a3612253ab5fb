"""Grammar compile and mask times: xgrammar (through ferrum's GrammarCompilerService) vs llguidance.

For each JSON schema (a typical tool call, a few others, `json_object`) and each vocabulary:
- cold: compile a grammar never seen before (`--iters` times, each schema given a fresh "title" so
  no cache can answer), p50 and p99 in ms; for xgrammar through `GrammarCompilerService.compile`
  (thread dispatch included), for llguidance `LLMatcher(tokenizer, grammar)`;
- warm: the grammar asked for again, p50 in us: a cache hit of the service (xgrammar), a
  `deep_copy` of a built matcher (llguidance, which has no compile cache);
- first mask: the first next-token bitmask of a new matcher (llguidance builds lazily, so part of
  its compile shows here), p50 in us;
- mask/token: mean us to fill one bitmask row along a random walk of up to 64 tokens (what the
  host spends per constrained request per decode step).

Vocabularies: `shipped` is ferrum-tiny-qwen3's tokenizer (8,192 tokens); `qwen-size` is a
synthetic byte-level BPE vocabulary of Qwen3's size (151,643 regular tokens: the shipped tokens
and concatenations of two of them, 3 special tokens, model vocab 151,936), built in memory (no
download). Timings are CPU, single process; llguidance is measured only if it is installed.
Usage: python benchmarks/bench_grammar_compile.py [--vocab shipped,qwen-size] [--iters 20]
       [--out results.json]
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import tokenizers
import torch

from ferrum.default_model import DEFAULT_MODEL_DIR
from ferrum.engine.tokenizer import Tokenizer
from ferrum.model_executor.token_bitmask import allocate_token_bitmask
from ferrum.sampling_params import StructuredOutputsParams
from ferrum.structured_output import GrammarCompilerService, GrammarSpec, build_tokenizer_info

try:
    import llguidance
    import llguidance.torch
except ImportError:
    llguidance = None

QWEN_REGULAR_TOKENS = 151_643
QWEN_MODEL_VOCAB = 151_936
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MASK_WALK_TOKENS = 64

TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "search_flights"},
        "arguments": {
            "type": "object",
            "properties": {
                "origin": {"type": "string", "description": "IATA code", "pattern": "^[A-Z]{3}$"},
                "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "date": {"type": "string", "format": "date"},
                "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                "cabin": {"enum": ["economy", "premium_economy", "business", "first"]},
                "nonstop": {"type": "boolean"},
                "max_price": {"type": "number", "minimum": 0},
            },
            "required": ["origin", "destination", "date"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["name", "age"],
}
ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "name": {"type": "string"}},
            "required": ["id", "name"],
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity", "price"],
            },
            "minItems": 1,
        },
        "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["order_id", "customer", "items", "status"],
}
WIDE = {
    "type": "object",
    "properties": {
        f"field_{i}": [{"type": "string"}, {"type": "integer"}, {"type": "boolean"}][i % 3]
        for i in range(30)
    },
    "required": [f"field_{i}" for i in range(0, 30, 2)],
}
SCHEMAS = {
    "tool_call": TOOL_CALL,
    "person": PERSON,
    "order": ORDER,
    "wide_30": WIDE,
    "json_object": {"type": "object"},
}


def shipped_tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def qwen_size_tokenizer() -> Tokenizer:
    """A byte-level BPE vocabulary of Qwen3's size: shipped tokens plus pairs of them."""
    shipped = shipped_tokenizer().backend.get_vocab(with_added_tokens=False)
    pieces = sorted(t for t in shipped if t not in SPECIAL_TOKENS)
    vocab = {t: i for i, t in enumerate(pieces)}
    rng = random.Random(0)
    while len(vocab) < QWEN_REGULAR_TOKENS:
        token = rng.choice(pieces) + rng.choice(pieces)
        vocab.setdefault(token, len(vocab))
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    model = tokenizers.models.BPE(vocab=vocab, merges=[])
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    config["additional_special_tokens"] = list(SPECIAL_TOKENS)
    return Tokenizer(backend, config)


def _titled(schema: dict, i: int) -> dict:
    return {**schema, "title": f"bench-{i}"}


def _percentiles_ms(seconds: list[float]) -> tuple[float, float]:
    p50, p99 = np.percentile(np.array(seconds) * 1e3, [50, 99])
    return float(p50), float(p99)


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _random_walk(
    fill: Callable[[torch.Tensor], None],
    accept: Callable[[int], bool],
    done: Callable[[], bool],
    vocab_size: int,
) -> float:
    """Mean seconds per bitmask fill along a walk over uniformly chosen allowed tokens."""
    generator = torch.Generator().manual_seed(0)
    bitmask = allocate_token_bitmask(1, vocab_size)
    times = []
    for _ in range(MASK_WALK_TOKENS):
        if done():
            break
        elapsed, _ = _timed(lambda: fill(bitmask))
        times.append(elapsed)
        shifts = torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask[0].unsqueeze(-1) >> shifts) & 1).flatten()[:vocab_size].nonzero()
        choice = int(allowed[torch.randint(len(allowed), (1,), generator=generator)])
        if not accept(choice):
            raise RuntimeError(f"token {choice} allowed by the mask was refused")
    return float(np.mean(times))


def bench_xgrammar(tokenizer: Tokenizer, vocab_size: int, iters: int) -> list[dict]:
    info = build_tokenizer_info(
        tokenizer, vocab_size=vocab_size, stop_token_ids=[tokenizer.eos_token_id]
    )
    service = GrammarCompilerService(info, timeout_s=600.0, max_workers=1, cache_size=4 * iters)
    try:
        return [
            _bench_xgrammar_schema(service, name, schema, vocab_size, iters)
            for name, schema in SCHEMAS.items()
        ]
    finally:
        service.shutdown()


def _bench_xgrammar_schema(
    service: GrammarCompilerService, name: str, schema: dict, vocab_size: int, iters: int
) -> dict:
    def spec_of(i: int) -> GrammarSpec:
        return GrammarSpec.from_params(StructuredOutputsParams(json=_titled(schema, i)))

    service.compile(spec_of(-1))  # first-use costs (thread start, allocator) are not timed
    cold = [_timed(lambda i=i: service.compile(spec_of(i)))[0] for i in range(iters)]
    warm = [_timed(lambda: service.compile(spec_of(0)))[0] for _ in range(iters)]
    grammar = service.compile(spec_of(0))
    bitmask = allocate_token_bitmask(1, vocab_size)
    first = []
    for _ in range(iters):
        matcher = grammar.new_matcher()
        first.append(_timed(lambda m=matcher: m.fill_bitmask(bitmask, 0))[0])
    walker = grammar.new_matcher()
    per_token = _random_walk(
        lambda b: walker.fill_bitmask(b, 0),
        lambda t: walker.accept_tokens([t]),
        walker.is_terminated,
        vocab_size,
    )
    return _row("xgrammar", name, cold, warm, first, per_token)


def bench_llguidance(tokenizer: Tokenizer, vocab_size: int, iters: int) -> list[dict]:
    ll_tokenizer = llguidance.LLTokenizer(
        tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=tokenizer.eos_token_id
    )
    return [
        _bench_llguidance_schema(ll_tokenizer, name, schema, vocab_size, iters)
        for name, schema in SCHEMAS.items()
    ]


def _bench_llguidance_schema(
    ll_tokenizer: object, name: str, schema: dict, vocab_size: int, iters: int
) -> dict:
    def build(i: int) -> llguidance.LLMatcher:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(_titled(schema, i))
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        if matcher.is_error():
            raise RuntimeError(f"llguidance refused {name}: {matcher.get_error()}")
        return matcher

    def fill(matcher: llguidance.LLMatcher, bitmask: torch.Tensor) -> None:
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask)

    build(-1)
    cold = [_timed(lambda i=i: build(i))[0] for i in range(iters)]
    template = build(0)
    warm = [_timed(template.deep_copy)[0] for _ in range(iters)]
    bitmask = allocate_token_bitmask(1, vocab_size)
    first = []
    for i in range(iters):
        matcher = build(1000 + i)
        first.append(_timed(lambda m=matcher: fill(m, bitmask))[0])
    walker = template.deep_copy()
    per_token = _random_walk(
        lambda b: fill(walker, b), walker.consume_token, walker.is_stopped, vocab_size
    )
    return _row("llguidance", name, cold, warm, first, per_token)


def _row(library, schema, cold, warm, first, per_token) -> dict:
    cold_p50, cold_p99 = _percentiles_ms(cold)
    return {
        "library": library,
        "schema": schema,
        "cold_p50_ms": cold_p50,
        "cold_p99_ms": cold_p99,
        "warm_p50_us": _percentiles_ms(warm)[0] * 1e3,
        "first_mask_p50_us": _percentiles_ms(first)[0] * 1e3,
        "mask_per_token_us": per_token * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", default="shipped,qwen-size")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    makers = {"shipped": shipped_tokenizer, "qwen-size": qwen_size_tokenizer}
    results = []
    for vocab_name in args.vocab.split(","):
        tokenizer = makers[vocab_name]()
        vocab_size = QWEN_MODEL_VOCAB if vocab_name == "qwen-size" else tokenizer.vocab_size
        libraries = [("xgrammar", bench_xgrammar)]
        if llguidance is not None:
            libraries.append(("llguidance", bench_llguidance))
        for _, bench in libraries:
            for row in bench(tokenizer, vocab_size, args.iters):
                results.append({"vocab": vocab_name, "vocab_size": vocab_size, **row})
                _print_row(results[-1], header=len(results) == 1)
    if llguidance is None:
        print("llguidance is not installed: only xgrammar measured")
    if args.out:
        args.out.write_text(json.dumps({"iters": args.iters, "results": results}, indent=1))


def _print_row(row: dict, header: bool) -> None:
    if header:
        print(
            f"{'vocab':<10} {'library':<10} {'schema':<11} {'cold p50 ms':>11} {'cold p99 ms':>11}"
            f" {'warm p50 us':>11} {'1st mask us':>11} {'mask/tok us':>11}"
        )
    print(
        f"{row['vocab']:<10} {row['library']:<10} {row['schema']:<11} {row['cold_p50_ms']:>11.2f}"
        f" {row['cold_p99_ms']:>11.2f} {row['warm_p50_us']:>11.1f}"
        f" {row['first_mask_p50_us']:>11.1f} {row['mask_per_token_us']:>11.1f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
