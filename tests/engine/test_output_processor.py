"""Output processor: core token updates become RequestOutputs (cumulative, delta or final-only),
with text, stop strings, logprobs, `n` completions under one id, aborts and id checks."""

from __future__ import annotations

import pytest

from ferrum.engine.core_messages import EngineCoreOutput, EngineCoreRequest
from ferrum.engine.input_processor import ProcessedPrompt, ProcessedRequest, child_request_id
from ferrum.engine.output_processor import OutputProcessor
from ferrum.engine.tokenizer import Tokenizer
from ferrum.outputs import Logprob
from ferrum.request import Logprobs
from ferrum.sampling_params import RequestOutputKind, SamplingParams
from tests.utils.tokenizer_files import build_tokenizer_dir

PROMPT = ProcessedPrompt("Tell me", [11, 12, 13])
CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_pretrained(build_tokenizer_dir(tmp_path_factory.mktemp("tok")))


@pytest.fixture
def words(tok: Tokenizer) -> list[int]:
    ids = tok.encode(" the river flows to the sea")
    assert len(ids) >= 5
    return ids


def add(processor: OutputProcessor, request_id: str, n: int = 1, **params) -> list[str]:
    """Adds a request with n completions; returns their ids (the core's request ids)."""
    child_ids = [child_request_id(request_id, i, n) for i in range(n)]
    sampling = SamplingParams(max_tokens=16, **params)
    requests = tuple(
        EngineCoreRequest(c, PROMPT.token_ids, sampling.resolve(), None, 0.0) for c in child_ids
    )
    processor.add_request(
        ProcessedRequest(request_id, PROMPT, sampling, sampling.output_kind, 0.0, requests)
    )
    return child_ids


def step(processor: OutputProcessor, *outputs: EngineCoreOutput) -> list:
    request_outputs, stopped = processor.process(list(outputs))
    assert stopped == []
    return request_outputs


def test_cumulative_outputs_hold_everything_so_far(tok, words) -> None:
    processor = OutputProcessor(tok)
    add(processor, "r", output_kind=CUMULATIVE)
    (first,) = step(processor, EngineCoreOutput("r", words[:1], num_cached_tokens=2))
    (second,) = step(processor, EngineCoreOutput("r", words[1:3]))
    (last,) = step(processor, EngineCoreOutput("r", words[3:5], finish_reason="length"))
    assert (first.prompt, first.prompt_token_ids) == ("Tell me", [11, 12, 13])
    # Each output's token list is its own: later steps leave earlier outputs unchanged.
    assert [o.outputs[0].token_ids for o in (first, second, last)] == [
        words[:1],
        words[:3],
        words[:5],
    ]
    assert [o.outputs[0].text for o in (second, last)] == [
        tok.decode(words[:3]),
        tok.decode(words[:5]),
    ]
    assert [o.finished for o in (first, second, last)] == [False, False, True]
    assert last.outputs[0].finish_reason == "length" and last.num_cached_tokens == 2
    assert last.metrics.num_generation_tokens == [5]
    assert not processor.has_request("r")


def test_delta_outputs_hold_only_what_is_new(tok, words) -> None:
    processor = OutputProcessor(tok)
    add(processor, "r", output_kind=DELTA)
    outputs = [step(processor, EngineCoreOutput("r", [t]))[0] for t in words[:4]]
    outputs += step(
        processor, EngineCoreOutput("r", [words[4]], finish_reason="stop", stop_reason=7)
    )
    assert [o.outputs[0].token_ids for o in outputs] == [[t] for t in words[:4]] + [[words[4]]]
    # The stop token ends the request and is not detokenized.
    assert "".join(o.outputs[0].text for o in outputs) == tok.decode(words[:4])
    assert (outputs[-1].outputs[0].finish_reason, outputs[-1].outputs[0].stop_reason) == ("stop", 7)


def test_final_only_outputs_once_with_everything(tok, words) -> None:
    processor = OutputProcessor(tok)
    add(processor, "r", output_kind=FINAL_ONLY)
    assert step(processor, EngineCoreOutput("r", words[:2])) == []
    (final,) = step(processor, EngineCoreOutput("r", words[2:3], finish_reason="length"))
    assert final.finished and final.outputs[0].token_ids == words[:3]
    assert final.outputs[0].text == tok.decode(words[:3])


def test_n_completions_come_out_together_in_index_order(tok, words) -> None:
    processor = OutputProcessor(tok)
    first, second = add(processor, "r", n=2, output_kind=CUMULATIVE)
    assert processor.child_ids("r") == ["0#r", "1#r"] == [first, second]
    (out,) = step(processor, EngineCoreOutput(second, words[:1]))
    assert [(c.index, c.token_ids) for c in out.outputs] == [(0, []), (1, words[:1])]
    (out,) = step(
        processor,
        EngineCoreOutput(first, words[1:2], finish_reason="length"),
        EngineCoreOutput(second, words[2:3]),
    )
    assert not out.finished and out.outputs[0].finish_reason == "length"
    (out,) = step(processor, EngineCoreOutput(second, words[3:4], finish_reason="length"))
    assert out.finished and [c.token_ids for c in out.outputs] == [
        words[1:2],
        words[:1] + words[2:4],
    ]
    assert out.metrics.num_generation_tokens == [1, 3]


def test_a_stop_string_finishes_a_completion_and_drops_its_later_tokens(tok) -> None:
    processor = OutputProcessor(tok)
    first, second = add(processor, "r", n=2, stop=["river"])
    ids = tok.encode(" the river flows")
    outputs, stopped = processor.process(
        [EngineCoreOutput(first, ids), EngineCoreOutput(second, tok.encode(" a"))]
    )
    # The core does not know stop strings: the front end tells it to stop that completion.
    assert stopped == [first]
    completion = outputs[0].outputs[0]
    assert (completion.text, completion.finish_reason, completion.stop_reason) == (
        " the ",
        "stop",
        "river",
    )
    # The ids after the one that completed the stop string (" flows") are dropped too.
    kept = tok.encode(" the river")
    assert completion.token_ids == kept and ids[: len(kept)] == kept and len(kept) < len(ids)
    (out,) = step(processor, EngineCoreOutput(first, [5]), EngineCoreOutput(second, [6]))
    assert out.outputs[0].token_ids == kept and out.outputs[1].token_ids == tok.encode(" a") + [6]


def test_a_stop_string_inside_a_step_drops_the_logprobs_after_it(tok) -> None:
    """A step of several tokens (accepted drafts) whose stop string ends before its last: the
    later tokens and their logprobs are not output."""
    processor = OutputProcessor(tok)
    add(processor, "r", stop=["river"], logprobs=0)
    ids = tok.encode(" the river flows")
    entries = [Logprobs([t], [-1.0], 1) for t in ids]
    outputs, stopped = processor.process([EngineCoreOutput("r", ids, logprobs=entries)])
    assert stopped == ["r"]
    completion = outputs[0].outputs[0]
    assert completion.token_ids == tok.encode(" the river")
    assert len(completion.logprobs) == len(completion.token_ids)
    assert completion.cumulative_logprob == -len(completion.token_ids)


def test_logprobs_keep_the_sampled_token_first_with_its_rank(tok) -> None:
    processor = OutputProcessor(tok)
    add(processor, "r", logprobs=2)
    # Sampled token 5 was the second most likely; the top-2 are 9 and 5.
    step(
        processor,
        EngineCoreOutput("r", [5], logprobs=[Logprobs([5, 9, 5], [-1.5, -0.25, -1.5], 2)]),
    )
    (out,) = step(
        processor,
        EngineCoreOutput(
            "r", [7], finish_reason="length", logprobs=[Logprobs([7, 7, 8], [-0.5, -0.5, -1.0], 1)]
        ),
    )
    completion = out.outputs[0]
    assert completion.logprobs == [
        {5: Logprob(-1.5, 2, tok.decode([5])), 9: Logprob(-0.25, 1, tok.decode([9]))},
        {7: Logprob(-0.5, 1, tok.decode([7])), 8: Logprob(-1.0, 2, tok.decode([8]))},
    ]
    assert completion.cumulative_logprob == -2.0


def test_abort_returns_the_final_output_and_forgets_the_request(words) -> None:
    processor = OutputProcessor(None)  # token ids only
    first, second = add(processor, "r", n=2)
    step(processor, EngineCoreOutput(first, words[:2], finish_reason="length"))
    out = processor.abort("r")
    assert out.finished and [c.finish_reason for c in out.outputs] == ["length", "abort"]
    assert out.outputs[0].token_ids == words[:2] and out.outputs[0].text == ""
    assert not processor.has_request("r") and not processor.has_request(second)
    assert processor.abort("r") is None
    assert step(processor, EngineCoreOutput(second, [1])) == []  # unknown ids are ignored


def test_request_ids_must_not_collide_with_completion_ids() -> None:
    processor = OutputProcessor(None)
    add(processor, "x", n=2)
    with pytest.raises(ValueError, match="'x' is already in use"):
        add(processor, "x")
    with pytest.raises(ValueError, match="'0#x' is already in use"):
        add(processor, "0#x")
    add(processor, "0#y")
    with pytest.raises(ValueError, match="'y' collides with request '0#y'"):
        add(processor, "y", n=2)
