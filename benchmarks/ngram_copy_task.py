"""N-gram speculation on a copy-heavy task with a trained model: the shipped model (ferrum's
tiny Qwen3 with its tokenizer) continues prompts that repeat a passage, greedy, 96 tokens each,
one request at a time, without speculation and with n-gram drafts of 3 and 5 tokens, after one
warm-up request. Prints the time per output token, drafts, draft tokens and accepted ones. CPU or
GPU (`--device`)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferrum import LLM, SamplingParams  # noqa: E402
from ferrum.default_model import DEFAULT_MODEL_DIR  # noqa: E402

PASSAGE = (
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. To create a new "
    "table, open the database and choose the table menu, then name each column."
)
PROMPTS = [f"{PASSAGE}\n{PASSAGE}\n{PASSAGE[:60]}", f"Copy this: {PASSAGE}\nCopy: {PASSAGE[:40]}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    reference = None
    for k in (None, 3, 5):
        spec = None if k is None else {"method": "ngram", "num_speculative_tokens": k}
        llm = LLM(
            DEFAULT_MODEL_DIR, dtype="float32", device=args.device, max_model_len=512,
            num_kv_blocks=256, speculative_config=spec,
        )  # fmt: skip
        llm.generate([PROMPTS[0]], params, use_tqdm=False)  # warm-up: compiles, graphs
        before = llm.llm_engine.stats()
        start = time.perf_counter()
        texts = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].text for p in PROMPTS]
        per_token = (time.perf_counter() - start) / (len(PROMPTS) * params.max_tokens)
        stats = llm.llm_engine.stats()
        counts = [
            getattr(stats, name) - getattr(before, name)
            for name in ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")
        ]
        reference = reference or texts
        print(
            f"k={k}: {per_token * 1e3:.2f} ms/token, drafts {counts[0]}, draft tokens "
            f"{counts[1]}, accepted {counts[2]}, outputs equal without speculation: "
            f"{texts == reference}"
        )
        llm.shutdown()


if __name__ == "__main__":
    main()
