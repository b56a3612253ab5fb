"""Constrained and free requests on the shipped model, to compare a multi-rank engine's texts
with one process's: `constrained_texts(**engine_kwargs)` runs the same requests on an `LLM` of
the shipped model (fp32 on the CPU, no whitespace in JSON) and shuts it down;
`one_process_texts(**engine_kwargs)` is the one-process reference, run once per session."""

from __future__ import annotations

import functools
import json

import jsonschema

from ferrum import LLM, SamplingParams
from ferrum.default_model import DEFAULT_MODEL_DIR
from ferrum.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}},
    "required": ["ok", "size"],
    "additionalProperties": False,
}
CHOICES = ["yes", "no", "maybe later"]
PROMPTS = ["The answer is", "Once upon a time", "The answer is"]
PARAMS = [
    SamplingParams(
        temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    ),
    SamplingParams(
        temperature=0.8,
        seed=5,
        max_tokens=10,
        structured_outputs=StructuredOutputsParams(choice=CHOICES),
    ),
    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
]


def constrained_texts(**engine_kwargs: object) -> list[str]:
    llm = LLM(
        DEFAULT_MODEL_DIR,
        dtype="float32",
        device="cpu",
        max_model_len=256,  # the KV pool sized by each rank (per layer group)
        num_cpu_threads=1,
        structured_outputs_config={"disable_any_whitespace": True},
        **engine_kwargs,
    )
    try:
        return [o.outputs[0].text for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        llm.shutdown()


@functools.cache
def one_process_texts(**engine_kwargs: object) -> tuple[str, ...]:
    """`constrained_texts` of one process (deterministic: greedy, or sampled with a seed),
    computed once per session for every test that compares a multi-rank engine with it."""
    return tuple(constrained_texts(**engine_kwargs))


def assert_valid(texts: list[str]) -> None:
    """The constrained requests' texts follow their constraints."""
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert texts[1] in CHOICES
