"""Pipeline parallelism through `LLM` with worker processes, on the CPU (gloo): every split of
the layers over stages (tied embeddings on a last stage without the embedding, a stage holding
no layer of a KV cache group, tensor parallelism inside each stage) gives the tokens, logprobs
and prompt logprobs of one process, through prefix hits, chunked prefill and preemption; the
stages keep one step each in flight, on disjoint requests; constrained requests sample what
one process does."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ferrum import LLM, SamplingParams
from tests.utils.constrained_requests import assert_valid, constrained_texts, one_process_texts
from tests.utils.tiny_llm import cuda_llm, greedy, make_llm, random_prompts

# A 92-token KV pool, 16-token steps and 4 requests at a time: the prompts below are chunked,
# and preempt each other.
ENGINE = dict(num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=4, num_cpu_threads=1)
PROMPT_LENGTHS = [9, 23, 30, 14, 27, 5]
SAMPLED = SamplingParams(temperature=0.8, seed=5, max_tokens=6, logprobs=2, prompt_logprobs=1)


def prompts_with_shared_prefixes() -> list[list[int]]:
    prompts = random_prompts(PROMPT_LENGTHS, seed=3)
    return prompts + [prompts[1][:20] + [7, 8, 9], prompts[2][:24] + [11]]


@pytest.fixture
def pipelined(request: pytest.FixtureRequest) -> Iterator[list[LLM]]:
    """Engines made by the test (appended to the list), shut down after it."""
    engines: list[LLM] = []
    yield engines
    for llm in engines:
        llm.llm_engine.core.shutdown()


def _sampled(llm: LLM, prompts: list[list[int]]) -> list[tuple]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SAMPLED, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outputs]


def _assert_same_sampling(got: list[tuple], expected: list[tuple]) -> None:
    for (tokens, logprobs, prompt_logprobs), (e_tokens, e_logprobs, e_prompt) in zip(
        got, expected, strict=True
    ):
        assert tokens == e_tokens
        for step, e_step in zip(logprobs + prompt_logprobs[1:], e_logprobs + e_prompt[1:]):
            assert step.keys() == e_step.keys()
            for token_id, lp in step.items():
                assert lp.rank == e_step[token_id].rank
                assert lp.logprob == pytest.approx(e_step[token_id].logprob, abs=1e-4)


@pytest.mark.parametrize(
    ("arch", "pp", "tp"),
    [
        # Two layers, tied embeddings: the last stage holds its own copy of the embedding.
        ("qwen2", 2, 1),
        # Three layers (sliding, global, sliding) on three stages: the middle one holds no
        # sliding-window layer, the others no global one.
        ("gemma3", 3, 1),
        # Expert-parallel MoE on two ranks inside each of two stages.
        ("qwen3_moe", 2, 2),
    ],
)
def test_pipeline_stages_give_the_tokens_of_one_process(
    tiny_checkpoint, pipelined: list[LLM], arch: str, pp: int, tp: int
) -> None:
    path = tiny_checkpoint(arch)
    extra = {"enable_expert_parallel": True} if arch == "qwen3_moe" else {}
    one = make_llm(path, **ENGINE, **extra)
    prompts = prompts_with_shared_prefixes()
    expected = greedy(one, prompts) + greedy(one, prompts)  # twice: prefix hits
    expected_sampled = _sampled(one, prompts[:3])
    llm = make_llm(
        path,
        pipeline_parallel_size=pp,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp",
        **ENGINE,
        **extra,
    )
    pipelined.append(llm)
    assert len(llm.llm_engine.core.executor.worker_pids) == pp * tp
    assert greedy(llm, prompts) + greedy(llm, prompts) == expected
    _assert_same_sampling(_sampled(llm, prompts[:3]), expected_sampled)
    stats = llm.llm_engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert max(PROMPT_LENGTHS) > ENGINE["max_num_batched_tokens"]  # chunked prefill
    assert not llm.llm_engine.has_unfinished_requests()


def test_each_stage_keeps_a_step_of_other_requests_in_flight(
    tiny_checkpoint, pipelined: list[LLM]
) -> None:
    path = tiny_checkpoint("qwen3")
    llm = make_llm(path, pipeline_parallel_size=2, distributed_executor_backend="mp", **ENGINE)
    pipelined.append(llm)
    core = llm.llm_engine.core
    in_flight: list[list[set[str]]] = []
    launch = core.executor.launch

    def recording_launch(scheduler_output, *args, **kwargs):  # noqa: ANN001, ANN202
        launched = launch(scheduler_output, *args, **kwargs)
        steps = [set(s.num_scheduled_tokens) for s, _ in core._in_flight]
        in_flight.append([*steps, set(scheduler_output.num_scheduled_tokens)])
        return launched

    core.executor.launch = recording_launch
    prompts = random_prompts([6, 7, 5, 8], seed=4)
    expected = greedy(make_llm(path, **ENGINE), prompts)
    assert greedy(llm, prompts) == expected
    full = [steps for steps in in_flight if len(steps) == 2 and all(steps)]
    # Most steps run while the other stage holds the previous one, never on the same requests.
    assert len(full) > len(in_flight) // 2
    assert all(not (a & b) for a, b in full)


def test_constrained_requests_match_one_process() -> None:
    expected = list(one_process_texts())
    texts = constrained_texts(pipeline_parallel_size=2, distributed_executor_backend="mp")
    assert texts == expected
    assert_valid(texts)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)
def test_cuda_stages_give_the_tokens_of_one_gpu(tiny_checkpoint, pipelined: list[LLM]) -> None:
    # NCCL sends between the stages and the token broadcast on its own stream, Triton kernels.
    path = tiny_checkpoint("qwen3_moe")
    prompts = prompts_with_shared_prefixes()
    one = cuda_llm(path, num_kv_blocks=64, enforce_eager=True)
    expected = greedy(one, prompts) + greedy(one, prompts)
    expected_sampled = _sampled(one, prompts[:3])
    del one
    llm = cuda_llm(
        path, pipeline_parallel_size=2, distributed_executor_backend="mp", num_kv_blocks=64
    )
    pipelined.append(llm)
    assert greedy(llm, prompts) + greedy(llm, prompts) == expected
    _assert_same_sampling(_sampled(llm, prompts[:3]), expected_sampled)
