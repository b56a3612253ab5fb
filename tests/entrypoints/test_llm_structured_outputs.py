"""Structured outputs through `LLM.generate` on the shipped model: every kind, sampled with several
seeds and temperatures and n > 1, always yields output its grammar accepts, with async scheduling
off and on; a grammar that does not compile in time fails its request alone; unconstrained
requests keep their greedy output beside constrained ones; async scheduling and preemption keep
matchers in step; min_tokens holds a grammar open while it can go on."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from ferrum import LLM, SamplingParams
from ferrum.default_model import DEFAULT_MODEL_DIR
from ferrum.engine.core_messages import EngineCoreRequest
from ferrum.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from ferrum.entrypoints.openai.tool_parsers.tool_choice import tool_call_structural_tag
from ferrum.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "ok": {"type": "boolean"},
        "size": {"enum": ["small", "large"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "ok", "size"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
CHOICES = ["yes", "no", "maybe later"]
EBNF = 'root ::= "(" digit digit? ")" " " ("up" | "down")\ndigit ::= [0-9]'
EBNF_AS_REGEX = r"\([0-9]{1,2}\) (up|down)"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "set_mode",
            "parameters": {
                "type": "object",
                "properties": {"mode": {"enum": ["fast", "slow"]}},
                "required": ["mode"],
                "additionalProperties": False,
            },
        },
    }
]
KINDS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar=EBNF),
    "json_object": StructuredOutputsParams(json_object=True),
    "structural_tag": StructuredOutputsParams(
        # One call: "required" with parallel calls lets a model call again until its budget ends.
        structural_tag=tool_call_structural_tag(HermesToolParser, TOOLS, "required", False)
    ),
}
PROMPTS = ["Once upon a time", "The answer is"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def check_output(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    elif kind == "grammar":
        assert re.fullmatch(EBNF_AS_REGEX, text), text
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    else:
        content, calls = HermesToolParser(TOOLS).extract_tool_calls(text)
        assert content == "" and calls, text
        for call in calls:
            assert call.name == "set_mode"
            jsonschema.validate(json.loads(call.arguments), TOOLS[0]["function"]["parameters"])


def make_llm(**kwargs) -> LLM:
    defaults = dict(
        dtype="float32",
        device="cpu",
        num_kv_blocks=128,
        max_model_len=256,
        # Random-ish tiny models would otherwise fill their budget with blanks between tokens.
        structured_outputs_config={"disable_any_whitespace": True},
    )
    return LLM(DEFAULT_MODEL_DIR, **(defaults | kwargs))


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request: pytest.FixtureRequest) -> LLM:
    return make_llm(async_scheduling=request.param)


def test_every_kind_always_matches_its_grammar(llm: LLM) -> None:
    prompts, params, kinds = [], [], []
    for kind, structured in KINDS.items():
        for i, temperature in enumerate((0.0, 0.7, 1.3)):
            prompts.append(PROMPTS[i % 2])
            params.append(
                SamplingParams(
                    temperature=temperature,
                    top_p=0.9 if i == 1 else 1.0,
                    n=1 if temperature == 0.0 else 2,
                    seed=None if i == 1 else 100 + i,
                    logprobs=2 if i == 2 else None,
                    max_tokens=80,
                    structured_outputs=structured,
                )
            )
            kinds.append(kind)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for kind, p, output in zip(kinds, params, outputs):
        assert len(output.outputs) == p.n
        for completion in output.outputs:
            assert completion.finish_reason == "stop", (kind, completion.text)
            check_output(kind, completion.text)
            if p.logprobs is not None:
                assert len(completion.logprobs) == len(completion.token_ids)
    assert not llm.llm_engine.has_unfinished_requests()


def test_unconstrained_greedy_output_is_unchanged_beside_constrained_requests(llm: LLM) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS, free, use_tqdm=False)
    constrained = [
        SamplingParams(temperature=0.8, seed=7, max_tokens=40, structured_outputs=s)
        for s in (KINDS["json"], KINDS["regex"])
    ]
    mixed = llm.generate(PROMPTS + PROMPTS, [free, free, *constrained], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    for kind, output in zip(("json", "regex"), mixed[2:]):
        check_output(kind, output.outputs[0].text)


def test_invalid_grammars_are_value_errors_naming_the_field(llm: LLM) -> None:
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a(b"))
    with pytest.raises(ValueError, match=r"prompts\[1\]: structured_outputs\.regex: invalid regex"):
        llm.generate(PROMPTS, [SamplingParams(max_tokens=2), bad], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.fixture
def blocked_compiles(llm: LLM):
    """The engine's compile service, whose compiles of a regex "slow" block until released."""
    service = llm.llm_engine.core.grammars._service_future().result()
    release = threading.Event()
    real_compile = service._compile_now

    def compile_blocking_slow(spec):
        if spec.text == "slow":
            release.wait()
        return real_compile(spec)

    service._compile_now = compile_blocking_slow
    timeout = service.timeout_s
    service.timeout_s = 0.05
    yield release
    release.set()
    service._compile_now = real_compile
    service.timeout_s = timeout


def test_a_compile_past_the_timeout_fails_its_request_alone(llm: LLM, blocked_compiles) -> None:
    engine = llm.llm_engine
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("free", PROMPTS[0], free)
    slow = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="slow"))
    with pytest.raises(
        ValueError,
        match=r"structured_outputs\.regex: the grammar did not compile within the 0\.05 s limit",
    ):
        engine.add_request("slow", PROMPTS[1], slow)
    # The same failure inside the core (the front end of another process let it through): that
    # request alone is aborted, the other finishes.
    request = EngineCoreRequest("slow-core", [5, 6, 7], slow.resolve(), None, 0.0)
    engine.core.add_request(request)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.core.step():
            if output.finish_reason is not None:
                finished[output.req_id] = output.finish_reason
    assert finished == {"free": "length", "slow-core": "abort"}


def test_async_scheduling_and_preemption_give_the_synchronous_tokens() -> None:
    """Async scheduling fills each constrained step's mask while its forward runs (the sampling
    waits for the previous step's tokens): greedy and seeded outputs, preempted and recomputed
    or not, are token for token those of synchronous scheduling."""
    kinds = ("json", "structural_tag", "json", "structural_tag")
    params = [
        SamplingParams(
            temperature=0.9 if seeded else 0.0,
            seed=5 + i if seeded else None,
            max_tokens=100,
            structured_outputs=KINDS[kind],
        )
        for i, (kind, seeded) in enumerate(zip(kinds, (False, True, True, False)))
    ]
    prompts = PROMPTS * 2
    roomy = make_llm(max_num_seqs=4, async_scheduling=False)
    expected = roomy.generate(prompts, params, use_tqdm=False)
    # 10 blocks of 16 tokens: the four requests cannot all keep their KV.
    tight = make_llm(max_num_seqs=4, num_kv_blocks=10, max_model_len=128, async_scheduling=True)
    runner = tight.llm_engine.core.executor.runner
    num_deferred = 0
    sample = runner.sample

    def counting_sample(step) -> None:
        nonlocal num_deferred
        num_deferred += 1
        sample(step)

    runner.sample = counting_sample
    squeezed = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.stats().num_preemptions > 0
    # Launched while the previous step ran, then sampled once its tokens were accepted (the
    # runner samples every other step itself, through its own method).
    assert num_deferred > 10
    assert [o.outputs[0].token_ids for o in squeezed] == [o.outputs[0].token_ids for o in expected]
    for kind, output in zip(kinds, squeezed):
        assert output.outputs[0].finish_reason == "stop"
        check_output(kind, output.outputs[0].text)


def test_min_tokens_keeps_a_grammar_open_until_it_can_only_end(llm: LLM) -> None:
    """Below min_tokens the grammar's end (EOS) and stop tokens are masked while the grammar
    allows anything else; a grammar that can only end still ends there (finish "stop"), so
    the output always matches it."""
    regex = StructuredOutputsParams(regex="(ok|fine)!*")
    choice = StructuredOutputsParams(choice=["yes", "no"])
    greedy = dict(temperature=0.0, max_tokens=20)
    plain, held, ended = llm.generate(
        [PROMPTS[0]] * 3,
        [
            SamplingParams(**greedy, structured_outputs=regex),
            SamplingParams(**greedy, min_tokens=6, structured_outputs=regex),
            SamplingParams(**greedy, min_tokens=10, structured_outputs=choice),
        ],
        use_tqdm=False,
    )
    # Without min_tokens this prompt ends after a few tokens; with it, the 7th token at the
    # earliest is the EOS.
    assert len(plain.outputs[0].token_ids) < 6
    completion = held.outputs[0]
    assert completion.finish_reason == "stop" and len(completion.token_ids) == 7
    assert re.fullmatch("(ok|fine)!*", completion.text), completion.text
    completion = ended.outputs[0]
    assert completion.finish_reason == "stop" and completion.text in ("yes", "no")
    assert len(completion.token_ids) < 10


def test_a_failed_deferred_sampling_loses_no_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose sampling fails after the previous step completed: its requests are
    recomputed with the tokens (and matcher states) they had, and finish as without the fault."""
    llm = make_llm(async_scheduling=True)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=KINDS["json"])
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    runner = engine.core.executor.runner
    real_sample = runner.sample
    calls = [0]

    def failing_sample(step) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected fault")
        real_sample(step)

    monkeypatch.setattr(runner, "sample", failing_sample)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    with pytest.raises(RuntimeError, match="injected fault"):
        while engine.has_unfinished_requests():
            engine.step()
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output.outputs[0]
    assert [outputs["0"].token_ids, outputs["1"].token_ids] == expected
    for completion in outputs.values():
        assert completion.finish_reason == "stop"
        check_output("json", completion.text)


def test_a_deferred_sampling_is_followed_by_the_next_forward_with_no_completion_between() -> None:
    """With async scheduling a constrained step's sampling is queued on the call after its
    launch, after the next step is scheduled, and the next forward is queued straight after it:
    the host's completion and output processing run while a forward is on the device."""
    llm = make_llm(async_scheduling=True)
    engine = llm.llm_engine
    core = engine.core
    runner = core.executor.runner
    calls: list[str] = []
    for name in ("launch", "sample", "complete"):
        method = getattr(runner, name)

        def recorded(*args, _name=name, _method=method, **kwargs):
            calls.append(_name)
            return _method(*args, **kwargs)

        setattr(runner, name, recorded)
    schedule = core.scheduler.schedule

    def recorded_schedule():
        calls.append("schedule")
        return schedule()

    core.scheduler.schedule = recorded_schedule
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=KINDS["json"])
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        before = len(calls)
        for output in engine.step():
            outputs[output.request_id] = output.outputs[0]
        # Each call ends with the step it launched still awaiting its sampling, or sampled.
        assert calls[before] == "schedule"
    for completion in outputs.values():
        check_output("json", completion.text)
    # The runner samples a step itself inside launch (recorded as "sample" after "launch");
    # a deferred sampling is one the core queues itself, between a schedule and a launch.
    deferred = [
        i for i, name in enumerate(calls) if name == "sample" and calls[i - 1] == "schedule"
    ]
    assert len(deferred) > 10
    for i in deferred:
        assert calls[i + 1] == "launch", calls[i - 2 : i + 3]
    assert "complete" not in calls[deferred[0] : deferred[0] + 2]
