"""Random logits, masked by the grammar, always give output the grammar's user can parse."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from grammar_fixtures import MODEL_VOCAB_SIZE, STOP_TOKEN_IDS, TOKENIZER_VOCAB_SIZE

from ferrum.default_model import DEFAULT_MODEL_DIR
from ferrum.engine.tokenizer import Tokenizer
from ferrum.model_executor.token_bitmask import allocate_token_bitmask, apply_token_bitmask_
from ferrum.sampling_params import StructuredOutputsParams
from ferrum.structured_output import (
    BatchBitmaskFiller,
    CompiledGrammar,
    FilledBitmaskRow,
    GrammarCompilerService,
    GrammarSpec,
)

SEEDS = range(6)
TEMPERATURES = (0.0, 0.7, 1.5)
# After this many tokens the random "model" favours closing tokens, so unbounded grammars
# (free strings, nesting) end in a few more tokens; the mask still decides what is legal.
WRAP_UP_AFTER = 40
MAX_TOKENS = 600
# Tokens that end a string, a number, an array, an object or a group (no digit: digits extend a
# number).
CLOSING_TEXTS = ('"', "}", "]", ")", ",")

TOOL_CALL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c d"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
        },
        "nickname": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]},
    },
    "required": ["name", "age", "address"],
}
PHONE_REGEX = r"(\+1 )?\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["yes", "no", 'say "maybe"', "ünïcode ✓"]
ARITHMETIC_EBNF = """
root ::= expr
expr ::= term ([+*-] term)*
term ::= [1-9] [0-9]? | "(" expr ")"
"""


def _closing_token_ids(tokenizer: Tokenizer) -> list[int]:
    vocab = tokenizer.backend.get_vocab()
    return [i for i in vocab.values() if tokenizer.decode([i]) in CLOSING_TEXTS]


def _sample(
    grammar: CompiledGrammar, seed: int, temperature: float, closing_ids: list[int]
) -> list[int]:
    """Mask -> sample -> accept until the matcher terminates; returns the tokens, stop included."""
    generator = torch.Generator().manual_seed(seed)
    matcher = grammar.new_matcher()
    bitmask = allocate_token_bitmask(1, MODEL_VOCAB_SIZE)
    token_ids: list[int] = []
    while not matcher.is_terminated():
        assert len(token_ids) < MAX_TOKENS, "the grammar did not end: " + repr(token_ids)
        matcher.fill_bitmask(bitmask, 0)
        logits = 4.0 * torch.randn(1, MODEL_VOCAB_SIZE, generator=generator)
        if len(token_ids) >= WRAP_UP_AFTER:
            logits[0, closing_ids] += 30.0
        apply_token_bitmask_(logits, bitmask)
        allowed = torch.isfinite(logits[0]).nonzero().flatten()
        assert allowed.numel() > 0, "the mask allowed no token"
        assert int(allowed.max()) < TOKENIZER_VOCAB_SIZE, "a padded vocabulary row was allowed"
        if temperature == 0.0:
            token_id = int(logits[0].argmax())
        else:
            probs = torch.softmax(logits[0] / temperature, dim=-1)
            token_id = int(torch.multinomial(probs, 1, generator=generator))
        assert matcher.accept_tokens([token_id])
        token_ids.append(token_id)
    assert token_ids[-1] in STOP_TOKEN_IDS
    return token_ids


def _outputs(
    compiler: GrammarCompilerService, tokenizer: Tokenizer, params: StructuredOutputsParams
) -> list[str]:
    grammar = compiler.compile(GrammarSpec.from_params(params))
    closing_ids = _closing_token_ids(tokenizer)
    texts = []
    for seed in SEEDS:
        for temperature in TEMPERATURES:
            token_ids = _sample(grammar, seed, temperature, closing_ids)
            # Special tokens other than the final stop token would show up here.
            texts.append(tokenizer.decode(token_ids[:-1], skip_special_tokens=False))
    return texts


@pytest.mark.parametrize("schema", [TOOL_CALL_SCHEMA, PERSON_SCHEMA], ids=["tool_call", "person"])
def test_json_schema_output_validates(compiler, tokenizer, schema):
    for text in _outputs(compiler, tokenizer, StructuredOutputsParams(json=schema)):
        jsonschema.validate(json.loads(text), schema)


def test_json_object_output_is_an_object(compiler, tokenizer):
    for text in _outputs(compiler, tokenizer, StructuredOutputsParams(json_object=True)):
        assert isinstance(json.loads(text), dict), text


def test_regex_output_matches(compiler, tokenizer):
    texts = _outputs(compiler, tokenizer, StructuredOutputsParams(regex=PHONE_REGEX))
    for text in texts:
        assert re.fullmatch(PHONE_REGEX, text), text
    assert any(t.startswith("+1") for t in texts) and any(t.startswith("(") for t in texts)


def test_choice_output_is_one_choice(compiler, tokenizer):
    texts = _outputs(compiler, tokenizer, StructuredOutputsParams(choice=CHOICES))
    assert set(texts) <= set(CHOICES)
    assert len(set(texts)) > 1


def test_ebnf_output_parses(compiler, tokenizer):
    for text in _outputs(compiler, tokenizer, StructuredOutputsParams(grammar=ARITHMETIC_EBNF)):
        assert re.fullmatch(r"[0-9+*()\-]+", text), text
        assert isinstance(eval(compile(text, "<grammar output>", "eval")), int)  # noqa: S307


def _allowed(matcher, vocab_size: int = MODEL_VOCAB_SIZE) -> torch.Tensor:
    bitmask = allocate_token_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, vocab_size)
    apply_token_bitmask_(logits, bitmask)
    return torch.isfinite(logits[0])


def test_rollback_restores_the_earlier_state(compiler, tokenizer):
    grammar = compiler.compile(GrammarSpec.from_params(StructuredOutputsParams(json=PERSON_SCHEMA)))
    token_ids = _sample(grammar, seed=3, temperature=1.0, closing_ids=_closing_token_ids(tokenizer))
    for num_rolled_back in (1, 2, 5, len(token_ids) // 2, len(token_ids)):
        matcher = grammar.new_matcher()
        assert matcher.accept_tokens(token_ids)
        assert matcher.is_terminated()
        matcher.rollback(num_rolled_back)
        assert not matcher.is_terminated()
        assert matcher.num_accepted_tokens == len(token_ids) - num_rolled_back
        fresh = grammar.new_matcher()
        assert fresh.accept_tokens(token_ids[: len(token_ids) - num_rolled_back])
        assert torch.equal(_allowed(matcher), _allowed(fresh))
        # Re-accepting the dropped tokens ends the grammar again.
        assert matcher.accept_tokens(token_ids[len(token_ids) - num_rolled_back :])
        assert matcher.is_terminated()


def test_rollback_past_the_accepted_tokens_is_refused(compiler):
    matcher = compiler.compile(
        GrammarSpec.from_params(StructuredOutputsParams(regex="ab+"))
    ).new_matcher()
    with pytest.raises(ValueError, match=r"num_tokens must be in \[0, 0\]"):
        matcher.rollback(1)
    with pytest.raises(ValueError, match="num_tokens"):
        matcher.rollback(-1)
    matcher.rollback(0)


def test_refused_token_is_not_accepted(compiler, tokenizer):
    grammar = compiler.compile(
        GrammarSpec.from_params(StructuredOutputsParams(choice=["yes", "no"]))
    )
    matcher = grammar.new_matcher()
    (token_x,) = tokenizer.encode("x", add_special_tokens=False)
    assert not matcher.accept_tokens([token_x])
    assert matcher.num_accepted_tokens == 0
    assert matcher.accept_tokens(tokenizer.encode("yes", add_special_tokens=False))
    allowed = _allowed(matcher)
    assert allowed.nonzero().flatten().tolist() == sorted(STOP_TOKEN_IDS)


def test_terminated_matcher_allows_only_stop_tokens(compiler, tokenizer):
    grammar = compiler.compile(GrammarSpec.from_params(StructuredOutputsParams(choice=["no"])))
    matcher = grammar.new_matcher()
    assert matcher.accept_tokens([*tokenizer.encode("no", add_special_tokens=False), 2])
    assert matcher.is_terminated()
    assert not matcher.accept_tokens([2])
    assert _allowed(matcher).nonzero().flatten().tolist() == sorted(STOP_TOKEN_IDS)


def test_special_and_padded_tokens_are_never_allowed(compiler, tokenizer):
    grammar = compiler.compile(GrammarSpec.from_params(StructuredOutputsParams(regex=r"(.|\n)*")))
    allowed = _allowed(grammar.new_matcher())
    special_not_stop = sorted(tokenizer.all_special_ids - set(STOP_TOKEN_IDS))
    assert special_not_stop and not allowed[special_not_stop].any()
    assert not allowed[TOKENIZER_VOCAB_SIZE:].any()
    assert allowed[:TOKENIZER_VOCAB_SIZE].sum() > TOKENIZER_VOCAB_SIZE - 100


def test_batch_fill_matches_one_row_at_a_time(compiler: GrammarCompilerService) -> None:
    grammars = [
        compiler.compile(GrammarSpec.from_params(StructuredOutputsParams(**kwargs)))
        for kwargs in ({"json": TOOL_CALL_SCHEMA}, {"regex": "[a-z]+@x"}, {"choice": ["ab", "c"]})
    ]
    matchers = [g.new_matcher() for g in grammars]
    assert matchers[1].accept_tokens([]) and matchers[2].accept_tokens([])
    # Row 3 is a terminated matcher: it allows only the stop tokens.
    done = grammars[2].new_matcher()
    tokenizer = Tokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    assert done.accept_tokens(tokenizer.encode("c", add_special_tokens=False) + [STOP_TOKEN_IDS[0]])
    assert done.is_terminated()
    rows = [(0, matchers[0]), (2, matchers[1]), (3, done), (4, matchers[2])]
    one_by_one = allocate_token_bitmask(5, MODEL_VOCAB_SIZE)
    for i, matcher in rows:
        matcher.fill_bitmask(one_by_one, i)
    batched = allocate_token_bitmask(5, MODEL_VOCAB_SIZE)
    BatchBitmaskFiller(max_threads=2).fill(batched, rows)
    assert torch.equal(batched, one_by_one)
    assert (batched[1] == -1).all()  # untouched


def test_filled_rows_stand_in_for_their_matchers(compiler: GrammarCompilerService) -> None:
    # What a tensor-parallel worker gets: rows the core filled, mixed here with a live matcher.
    grammars = [
        compiler.compile(GrammarSpec.from_params(StructuredOutputsParams(**kwargs)))
        for kwargs in ({"regex": "[a-z]+@x"}, {"choice": ["ab", "c"]})
    ]
    filled = allocate_token_bitmask(2, MODEL_VOCAB_SIZE)
    for i, grammar in enumerate(grammars):
        grammar.new_matcher().fill_bitmask(filled, i)
    live = grammars[0].new_matcher()
    rows = [(0, FilledBitmaskRow(filled, 1)), (1, live), (3, FilledBitmaskRow(filled, 0))]
    batched = allocate_token_bitmask(4, MODEL_VOCAB_SIZE)
    BatchBitmaskFiller(max_threads=2).fill(batched, rows)
    assert torch.equal(batched[0], filled[1])
    assert torch.equal(batched[1], filled[0]) and torch.equal(batched[3], filled[0])
    assert (batched[2] == -1).all()
