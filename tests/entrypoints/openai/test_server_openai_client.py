"""The official openai client against a live `ferrum serve`."""

from __future__ import annotations

import httpx
import pytest

from ferrum.default_model import DEFAULT_MODEL_NAME
from tests.utils.remote_server import RemoteServer

MODEL = DEFAULT_MODEL_NAME
PROMPT = "Once upon a time"


def test_models_list(server: RemoteServer) -> None:
    models = server.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].owned_by == "ferrum"


def test_completion_greedy_with_usage(server: RemoteServer) -> None:
    client = server.client()
    result = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = result.choices[0]
    assert choice.finish_reason == "length" and choice.text
    prompt_ids = httpx.post(
        server.url + "/tokenize", json={"prompt": PROMPT}, headers=server.headers, timeout=10
    ).json()["tokens"]
    assert result.usage.prompt_tokens == len(prompt_ids)
    assert result.usage.completion_tokens == 6
    assert result.usage.total_tokens == len(prompt_ids) + 6
    again = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert again.choices[0].text == choice.text


def test_completion_stream_matches_non_stream(server: RemoteServer) -> None:
    client = server.client()
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    chunks = list(
        client.completions.create(
            **kwargs,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_echo_and_token_prompt(server: RemoteServer) -> None:
    client = server.client()
    echoed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, temperature=0
    )
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    ids = httpx.post(
        server.url + "/tokenize", json={"prompt": PROMPT}, headers=server.headers, timeout=10
    ).json()["tokens"]
    from_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    assert from_ids.choices[0].text == plain.choices[0].text


def test_completion_logprobs_shape(server: RemoteServer) -> None:
    result = server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3
    )
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert len(logprobs.text_offset) == len(logprobs.top_logprobs) == 4
    assert "".join(logprobs.tokens) == result.choices[0].text
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert value <= 0 and 3 <= len(top) <= 4
        # Greedy: the sampled token is the most likely one.
        assert top[token] == pytest.approx(max(top.values()))


def test_chat_and_stream(server: RemoteServer) -> None:
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    full = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 8 and full.usage.prompt_tokens > 5
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_completion_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_chat_logprobs_shape(server: RemoteServer) -> None:
    result = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode())


def test_n_completions(server: RemoteServer) -> None:
    result = server.client().completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=5,
        n=3,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    assert result.usage.completion_tokens == 15
    stream = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        n=2,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    # Greedy: both completions are the same.
    assert texts[0] == texts[1] != ""


def test_seeded_sampling_is_reproducible(server: RemoteServer) -> None:
    client = server.client()

    def sample(seed: int) -> str:
        result = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=1.5,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return result.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_stop_string(server: RemoteServer) -> None:
    client = server.client()
    base = (
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    words = base.split()
    assert len(words) >= 3
    stop = " " + words[2]
    cut = base[: base.index(stop)]
    for stream in (False, True):
        result = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop], stream=stream
        )
        chunks = list(result) if stream else [result]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == cut
        finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finals[-1].finish_reason == "stop"


def test_tokenize_detokenize_version(server: RemoteServer) -> None:
    tokens = httpx.post(
        server.url + "/tokenize", json={"prompt": "hello world"}, headers=server.headers, timeout=10
    ).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 512
    text = httpx.post(
        server.url + "/detokenize",
        json={"tokens": tokens["tokens"]},
        headers=server.headers,
        timeout=10,
    )
    assert text.json() == {"prompt": "hello world"}
    chat = httpx.post(
        server.url + "/tokenize",
        json={"messages": [{"role": "user", "content": "hi"}]},
        headers=server.headers,
        timeout=10,
    ).json()
    assert chat["count"] > tokens["count"]
    import ferrum

    assert httpx.get(server.url + "/version", timeout=10).json() == {"version": ferrum.__version__}


def test_metrics_exposed(server: RemoteServer) -> None:
    server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    metrics = server.metrics()
    for name in (
        "ferrum:num_requests_running",
        "ferrum:num_requests_waiting",
        "ferrum:kv_cache_usage_perc",
        "ferrum:prefix_cache_queries_total",
        "ferrum:prefix_cache_hits_total",
        "ferrum:prompt_tokens_total",
        "ferrum:generation_tokens_total",
        "ferrum:time_to_first_token_seconds_count",
        "ferrum:time_per_output_token_seconds_count",
        "ferrum:e2e_request_latency_seconds_count",
        "ferrum:inter_token_latency_seconds_count",
        "ferrum:request_queue_time_seconds_count",
        "ferrum:request_prefill_time_seconds_count",
        "ferrum:request_decode_time_seconds_count",
        "ferrum:request_inference_time_seconds_count",
        "ferrum:iteration_tokens_total_count",
    ):
        assert name in metrics, name
    assert metrics["ferrum:iteration_tokens_total_sum"] >= 2
    assert metrics["ferrum:generation_tokens_total"] >= 2
    assert metrics["ferrum:e2e_request_latency_seconds_count"] >= 1


def _tokens(server: RemoteServer, text: str) -> list[int]:
    response = httpx.post(
        server.url + "/tokenize", json={"prompt": text}, headers=server.headers, timeout=10
    )
    return response.json()["tokens"]


def test_prompt_logprobs_and_echo_with_logprobs_agree(server: RemoteServer) -> None:
    """vLLM's prompt_logprobs field (first position null, the prompt token's entry in each) and
    the legacy echo + logprobs shape carry the same numbers; a stream sends the same tokens."""
    client = server.client()
    prompt_ids = _tokens(server, PROMPT)
    common = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    result = client.completions.create(
        **common, echo=True, extra_body={"prompt_logprobs": 1, "ignore_eos": True}
    )
    choice = result.choices[0]
    prompt_logprobs = choice.model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    for token_id, entry in zip(prompt_ids[1:], prompt_logprobs[1:]):
        assert str(token_id) in entry and entry[str(token_id)]["logprob"] <= 0.0
        assert entry[str(token_id)]["rank"] >= 1 and len(entry) <= 3  # top-2, echo's
    logprobs = choice.logprobs
    assert logprobs is not None and choice.text.startswith(PROMPT)
    assert len(logprobs.tokens) == len(prompt_ids) + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for position, token_id in enumerate(prompt_ids[1:], 1):
        expected = prompt_logprobs[position][str(token_id)]["logprob"]
        assert logprobs.token_logprobs[position] == pytest.approx(expected)
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset[len(prompt_ids)] == len(PROMPT)

    tokens, token_logprobs, text = [], [], ""
    for chunk in client.completions.create(
        **common, echo=True, stream=True, extra_body={"ignore_eos": True}
    ):
        for streamed in chunk.choices:
            text += streamed.text
            if streamed.logprobs is not None:
                tokens += streamed.logprobs.tokens
                token_logprobs += streamed.logprobs.token_logprobs
    assert text == choice.text and tokens == logprobs.tokens
    assert token_logprobs == pytest.approx(logprobs.token_logprobs)


def test_chat_prompt_logprobs(server: RemoteServer) -> None:
    result = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )
    prompt_logprobs = result.model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == result.usage.prompt_tokens
    assert all(len(entry) == 1 for entry in prompt_logprobs[1:])
