"""Acceptance and batch-1 speed of an EAGLE-3 head (and of n-gram lookup) for the shipped tiny
model, on held-out prompts, through ferrum's engine on the CPU.

    python tools/eval_eagle3_head.py --head ferrum/model_files/ferrum-tiny-qwen3-eagle3

Prompts: the model card's four sample prompts and held-out prompts of train_eagle3_head.py
(first words no train prompt starts with; another seed than its held-out data). Each
configuration (no speculation, eagle3 k = 1, 3, 5, ngram k = 3) runs every prompt alone
(batch 1), greedy and at T=0.8 / top-p 0.95 / top-k 50 with a seed per prompt, `max_tokens`
new tokens, end-of-text ignored. Reports the engine's spec counters (acceptance rate =
accepted / draft tokens; mean acceptance length = 1 + accepted / drafts, vLLM's), output
tokens a second, and whether the outputs equal those without speculation."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import ferrum  # noqa: F401  (before torch: ferrum sets the CPU threads' wait policy)
from ferrum import LLM, SamplingParams
from ferrum.default_model import DEFAULT_MODEL_DIR

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_eagle3_head import make_prompts  # noqa: E402

CARD_PROMPTS = ("The Python interpreter", "A database index is", "To create a new table,",
                "Rust programs")  # fmt: skip


def prompts(n: int) -> list[dict]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    held = [{"prompt_token_ids": p} for p in make_prompts(tokenizer, True, n, seed=3)]
    return [{"prompt": p} for p in CARD_PROMPTS] + held


def run(spec: dict | None, items: list[dict], max_tokens: int) -> dict:
    llm = LLM(DEFAULT_MODEL_DIR, device="cpu", dtype="float32", speculative_config=spec)
    llm.generate(items[:1], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    result = {}
    for name, temperature in (("greedy", 0.0), ("T0.8", 0.8)):
        before = llm.llm_engine.stats()
        outputs, tokens, start = [], 0, time.perf_counter()
        for i, item in enumerate(items):
            params = SamplingParams(temperature=temperature, top_p=0.95, top_k=50, seed=i,
                                    max_tokens=max_tokens, ignore_eos=True)  # fmt: skip
            out = llm.generate([item], params, use_tqdm=False)[0].outputs[0]
            outputs.append(list(out.token_ids))
            tokens += len(out.token_ids)
        seconds = time.perf_counter() - start
        after = llm.llm_engine.stats()
        drafts = after.spec_num_drafts - before.spec_num_drafts
        draft_tokens = after.spec_num_draft_tokens - before.spec_num_draft_tokens
        accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        result[name] = {
            "outputs": outputs,
            "tok_s": tokens / seconds,
            "drafts": drafts,
            "draft_tokens": draft_tokens,
            "accepted": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "acceptance_length": 1 + accepted / drafts if drafts else None,
        }
    llm.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", required=True)
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts besides the 4")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 3, 5])
    parser.add_argument("--json", help="write the figures (without outputs) here")
    args = parser.parse_args()
    items = prompts(args.prompts)
    configs = {"none": None}
    for k in args.ks:
        configs[f"eagle3 k={k}"] = {"method": "eagle3", "model": args.head,
                                    "num_speculative_tokens": k}  # fmt: skip
    configs["ngram k=3"] = {"method": "ngram", "num_speculative_tokens": 3}
    base, table = None, {}
    for name, spec in configs.items():
        result = run(spec, items, args.max_tokens)
        base = base or result
        for mode, r in result.items():
            same = r["outputs"] == base[mode]["outputs"]
            if mode == "greedy":
                assert same, f"{name}: greedy output differs from no speculation"
            r = {key: value for key, value in r.items() if key != "outputs"}
            r["same_as_none"] = same
            r["speedup"] = r["tok_s"] / base[mode]["tok_s"]
            table[f"{name} {mode}"] = r
            print(f"{name:12} {mode:6} {json.dumps(r)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
