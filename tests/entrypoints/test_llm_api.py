"""The offline `LLM` API on the shipped model: text in, text out, stops, logprobs, chat, errors."""

from __future__ import annotations

import math

import pytest

from ferrum import LLM, SamplingParams
from ferrum.default_model import DEFAULT_MODEL_DIR
from tests.utils.processes import wait_gone
from tests.utils.tiny_llm import make_llm


@pytest.fixture
def llm(shipped_llm: LLM) -> LLM:
    return shipped_llm


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kwargs)


def test_prompts_of_every_form_come_back_in_order(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("The river")
    outputs = llm.generate(
        ["Once upon a time", {"prompt_token_ids": ids}, {"prompt": "In the year"}],
        greedy(max_tokens=6, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.prompt for o in outputs] == ["Once upon a time", None, "In the year"]
    assert outputs[0].prompt_token_ids == tokenizer.encode("Once upon a time")
    assert outputs[1].prompt_token_ids == ids
    for output in outputs:
        completion = output.outputs[0]
        assert output.finished and completion.finish_reason == "length"
        assert len(completion.token_ids) == 6
        assert completion.text == tokenizer.decode(completion.token_ids)


def test_stop_string_across_token_boundaries(llm: LLM) -> None:
    prompt = "The history of the"
    full = llm.generate(prompt, greedy(max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    text = full.outputs[0].text
    assert len(text) > 12
    # A stop string that starts inside one token and ends inside a later one.
    stop = text[5:11]
    cut = text.index(stop)
    out = llm.generate(prompt, greedy(max_tokens=24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (text[:cut], "stop", stop)
    kept = llm.generate(
        prompt, greedy(max_tokens=24, stop=stop, include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert kept.text == text[: cut + len(stop)]


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    prompt = "A long time ago"
    base = llm.generate(prompt, greedy(max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    tokens = base.outputs[0].token_ids
    stop_id = tokens[4]
    first = tokens.index(stop_id)
    out = llm.generate(prompt, greedy(max_tokens=12, stop_token_ids=[stop_id]), use_tqdm=False)
    completion = out[0].outputs[0]
    assert completion.token_ids == tokens[: first + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_id)
    assert completion.text == llm.get_tokenizer().decode(tokens[:first])


def test_logprobs(llm: LLM) -> None:
    out = llm.generate("Water is", greedy(max_tokens=5, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    total = 0.0
    for token_id, entry in zip(out.token_ids, out.logprobs):
        assert token_id in entry and entry[token_id].rank == 1  # greedy takes the argmax
        assert len(entry) == 3  # the sampled token is also the top-1
        values = sorted((lp.logprob for lp in entry.values()), reverse=True)
        assert values[0] == entry[token_id].logprob <= 0.0
        assert sorted(lp.rank for lp in entry.values()) == [1, 2, 3]
        total += entry[token_id].logprob
    assert math.isclose(out.cumulative_logprob, total, rel_tol=1e-6)


def test_chat_uses_the_chat_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Tell me about rivers."}]
    out = llm.chat(messages, greedy(max_tokens=8), use_tqdm=False)[0]
    rendered = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert out.prompt == rendered
    assert out.prompt_token_ids == llm.get_tokenizer().encode(rendered, add_special_tokens=False)


def test_max_tokens_none_fills_the_context() -> None:
    small = LLM(
        DEFAULT_MODEL_DIR, dtype="float32", device="cpu", num_kv_blocks=16, max_model_len=40
    )
    out = small.generate("Hello", SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(out[0].prompt_token_ids) + len(out[0].outputs[0].token_ids) == 40


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("word " * 600, SamplingParams(max_tokens=4), "max_model_len=512"),
        ({"prompt_token_ids": []}, SamplingParams(), "empty"),
        ({"prompt_token_ids": [1, 99999]}, SamplingParams(), r"outside \[0, 8192\)"),
        ({"prompt_token_ids": "abc"}, SamplingParams(), "list of integers"),
    ],
)
def test_bad_requests_fail_alone(llm: LLM, prompt, params, message) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(["fine prompt", prompt], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate("still serving", greedy(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_sampling_params_count_must_match(llm: LLM) -> None:
    with pytest.raises(ValueError, match="sampling_params: got 2 for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()], use_tqdm=False)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"n": 0}, "n"),
        ({"min_p": 2.0}, "min_p"),
        ({"logprobs": 100}, "logprobs"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**kwargs)


def test_abort_returns_blocks_at_once(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("abort-me", "Once upon a time", greedy(max_tokens=50, ignore_eos=True))
    engine.step()
    kv = engine.core.kv_cache_manager
    assert kv.usage > 0
    (final,) = engine.abort_request("abort-me")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert kv.usage == 0.0 and not engine.has_unfinished_requests()


def test_stop_string_completed_by_the_last_allowed_token(llm: LLM) -> None:
    prompt = "The history of the"
    text = llm.generate(prompt, greedy(max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    text = text.outputs[0].text
    stop = text[-4:]
    out = llm.generate(prompt, greedy(max_tokens=12, stop=stop), use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (
        text[: text.index(stop)],
        "stop",
        stop,
    )


def test_request_ids_cannot_collide_with_completion_ids(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("x", "Hello", SamplingParams(n=2, max_tokens=2, seed=1))
    with pytest.raises(ValueError, match="collides|already in use"):
        engine.add_request("0#x", "Hello", SamplingParams(max_tokens=2))
    engine.abort_request("x")
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": True},
        {"logprobs": 2.5},
        {"temperature": "1"},
        {"seed": 2**70},
        {"seed": 2**63 - 1, "n": 2},
        {"n": 10**8},
        {"max_tokens": True},
    ],
)
def test_sampling_params_reject_wrong_types_and_ranges(kwargs) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{next(iter(kwargs))} "):
        SamplingParams(**kwargs)


def test_text_that_is_not_valid_unicode_is_a_value_error(llm: LLM) -> None:
    with pytest.raises(ValueError, match="not valid Unicode"):
        llm.generate("bad \udcff text", greedy(max_tokens=2), use_tqdm=False)


def test_stop_strings_without_a_tokenizer_are_rejected(tiny_checkpoint) -> None:
    llm = LLM(tiny_checkpoint("qwen3"), skip_tokenizer_init=True, device="cpu", num_kv_blocks=16)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(stop="x"), use_tqdm=False)


@pytest.mark.parametrize("args", [(), ("ferrum-tiny-qwen3",)])
def test_llm_without_a_model_or_by_name_is_the_shipped_model(args: tuple[str, ...]) -> None:
    llm = LLM(*args, device="cpu", num_kv_blocks=16, max_model_len=64, tensor_parallel_size=1)
    assert llm.llm_engine.config.model_config.model == DEFAULT_MODEL_DIR


@pytest.mark.parametrize("prompts", [123, [1, 2, 3], ["ok", None], b"bytes"])
def test_prompts_of_a_wrong_type_are_a_type_error(llm: LLM, prompts) -> None:
    with pytest.raises(TypeError, match=r"must be a string, \{'prompt': str\}"):
        llm.generate(prompts, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_vllm_arguments_not_supported_yet_say_so() -> None:
    with pytest.raises(ValueError, match="revision='main': not supported yet by ferrum"):
        LLM(revision="main")
    with pytest.raises(TypeError, match="unexpected engine argument 'max_num_seq'"):
        LLM(max_num_seq=4)


def test_request_metrics_carry_the_timeline(llm: LLM) -> None:
    before = llm.llm_engine.stats()
    [output] = llm.generate("Hello", greedy(n=2, max_tokens=4, ignore_eos=True), use_tqdm=False)
    m = output.metrics
    assert m is not None and m.first_scheduled_time is not None
    assert m.first_token_time is not None and m.last_token_time is not None
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
    assert m.finished_time is not None and m.last_token_time <= m.finished_time
    # One gap per token after the first, of each completion.
    assert len(m.inter_token_latencies) == 2 * 3
    after = llm.llm_engine.stats()
    num_steps = sum(after.iteration_tokens_counts) - sum(before.iteration_tokens_counts)
    assert num_steps >= 4
    assert after.iteration_tokens_sum - before.iteration_tokens_sum >= 2 * 3 + 1


def test_the_progress_bar_shows_token_rates(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    llm.generate(["a", "b"], greedy(max_tokens=2, ignore_eos=True), use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts: 100%" in err and "2/2" in err
    assert "est. speed input:" in err and "output:" in err and "toks/s" in err


def test_prompt_logprobs_are_decoded(llm: LLM) -> None:
    params = SamplingParams(max_tokens=2, prompt_logprobs=1)
    (output,) = llm.generate("Hello there, world", params, use_tqdm=False)
    prompt_logprobs = output.prompt_logprobs
    assert prompt_logprobs is not None and prompt_logprobs[0] is None
    assert len(prompt_logprobs) == len(output.prompt_token_ids)
    tokenizer = llm.get_tokenizer()
    for token_id, entry in zip(output.prompt_token_ids[1:], prompt_logprobs[1:]):
        assert entry is not None and 1 <= len(entry) <= 2
        assert entry[token_id].decoded_token == tokenizer.decode([token_id])


def test_logit_bias_allowed_token_ids_and_bad_words(llm: LLM) -> None:
    prompt = "The history of the"
    base = llm.generate(prompt, greedy(max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    tokens = base.outputs[0].token_ids
    favoured = (tokens[0] + 1) % 8192
    biased = llm.generate(
        prompt, greedy(max_tokens=4, ignore_eos=True, logit_bias={favoured: 100}), use_tqdm=False
    )[0].outputs[0]
    assert biased.token_ids == [favoured] * 4
    allowed = [tokens[1], 100, 200]
    out = llm.generate(
        prompt,
        SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=6, allowed_token_ids=allowed),
        use_tqdm=False,
    )[0]
    assert all(set(c.token_ids) <= set(allowed) for c in out.outputs)
    # Banning the greedy continuation's second word: its tokens never follow each other again.
    tokenizer = llm.get_tokenizer()
    word = base.outputs[0].text.split()[1]
    banned = llm.generate(
        prompt, greedy(max_tokens=8, ignore_eos=True, bad_words=[word]), use_tqdm=False
    )[0].outputs[0]
    for ids in (tokenizer.encode(w, add_special_tokens=False) for w in (word, " " + word)):
        windows = [banned.token_ids[i : i + len(ids)] for i in range(len(banned.token_ids))]
        assert ids not in windows
    assert banned.token_ids != tokens


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logit_bias": {8192: 1.0}}, r"logit_bias: token id 8192 is outside \[0, 8192\)"),
        ({"allowed_token_ids": [1, 9000]}, r"allowed_token_ids: token id 9000 is outside"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused(llm: LLM, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate("Hello", SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)


def test_shutdown_stops_the_worker_processes_and_refuses_later_calls(tiny_checkpoint) -> None:
    llm = make_llm(
        tiny_checkpoint("qwen3"),
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        num_kv_blocks=24,
        num_cpu_threads=1,
    )
    pids = llm.llm_engine.core.executor.worker_pids
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy(max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    llm.shutdown()
    wait_gone(pids)
    llm.shutdown()  # twice is fine
    with pytest.raises(RuntimeError, match=r"generate after shutdown\(\)"):
        llm.generate([{"prompt_token_ids": [5]}], greedy(max_tokens=1), use_tqdm=False)
