"""Speculative decoding on the shipped model (its tokenizer), greedy, n-gram drafts on text that
repeats: requests with structured outputs speculate (each verify row masked after the drafts
before it) and stay valid, and stop strings end outputs as without speculation; every output
equals the one without speculation."""

from __future__ import annotations

import json

from ferrum import LLM, SamplingParams
from ferrum.default_model import DEFAULT_MODEL_DIR
from ferrum.sampling_params import StructuredOutputsParams
from tests.utils.speculation import NGRAM

ENGINE = dict(dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=256)


def speculating_and_plain() -> tuple[LLM, LLM]:
    return LLM(DEFAULT_MODEL_DIR, speculative_config=NGRAM, **ENGINE), LLM(
        DEFAULT_MODEL_DIR, **ENGINE
    )


def texts(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


def test_constrained_requests_decode_beside_speculating_ones() -> None:
    """A JSON-schema request and free requests whose text repeats, in one batch, all
    speculating: the JSON stays valid and every output equals its output without speculation."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    }
    prompts = ["Write a person as JSON:", "one two three one two three one two", "a b a b a b a"]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(json=schema),
        ),
        *[SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 2,
    ]
    llm, plain = speculating_and_plain()
    got = texts(llm, prompts, params)
    assert got == texts(plain, prompts, params)
    assert set(json.loads(got[0])) == {"name", "ok"}
    assert llm.llm_engine.stats().spec_num_accepted_tokens > 0


def test_a_grammar_masks_each_verify_row_after_the_drafts_before_it() -> None:
    """A regex the text repeats under (n-gram drafts hit): drafts of the constrained request are
    accepted, its output equals the output without speculation, and a grammar that refuses
    the proposed continuation (a choice the prompt never shows) still gives the same output."""
    prompts = ["a b a b a b a", "a b a b a b a"]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=24,
            structured_outputs=StructuredOutputsParams(regex="( b a){6}"),
        ),
        SamplingParams(
            temperature=0.0,
            max_tokens=8,
            structured_outputs=StructuredOutputsParams(choice=[" b c d", " b a x"]),
        ),
    ]
    llm, plain = speculating_and_plain()
    got = texts(llm, prompts, params)
    assert got == texts(plain, prompts, params)
    assert got[0] == " b a" * 6 and got[1] in (" b c d", " b a x")
    assert llm.llm_engine.stats().spec_num_accepted_tokens > 0


def test_stop_strings_end_outputs_as_without_speculation() -> None:
    """For stop strings all along the text, the tokens, text and logprobs equal those without
    speculation (the accepted drafts after the token that completes a stop string are not
    output)."""
    prompt = "a b a b a b a"
    llm, base = speculating_and_plain()
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    text = base.generate(prompt, free, use_tqdm=False)[0].outputs[0].text
    stops = [text[i : i + 5] for i in range(8, len(text) - 5, 2)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], logprobs=0) for stop in stops
    ]

    def completions(engine: LLM) -> list[tuple]:
        outputs = engine.generate([prompt] * len(stops), params, use_tqdm=False)
        return [
            (c.token_ids, c.text, c.finish_reason, len(c.logprobs))
            for c in (o.outputs[0] for o in outputs)
        ]

    assert completions(llm) == completions(base)
    assert llm.llm_engine.stats().spec_num_accepted_tokens > 0
