"""Greedy tokens with LoRA adapters through the whole engine equal transformers + PEFT with the
same adapters (unmerged and merged): several adapters and the base model mixed in one batch,
chunked prefill with preemption, slot and host-cache swaps beyond max_loras / max_cpu_loras,
prefix-cache hits that never cross adapters, and the Triton kernels under the CPU interpreter."""

from __future__ import annotations

import pytest
import torch

from ferrum import LoRARequest, SamplingParams
from tests.utils.lora_adapters import peft_greedy
from tests.utils.tiny_llm import MAX_TOKENS, make_llm, random_prompts

needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available(), reason="Triton CPU interpreter: the CUDA tests cover the GPU"
)


def _greedy(llm, prompts, loras):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
    )
    assert [o.lora_request for o in outputs] == loras
    return [o.outputs[0].token_ids for o in outputs]


def _path(lora):
    return None if lora is None else lora.lora_path


def _expected(base, prompts, loras, merged=False):
    """PEFT's greedy tokens per prompt, one model per adapter (cached over the module)."""
    for lora in set(loras):
        todo = [
            p
            for p, other in zip(prompts, loras)
            if other == lora and (base, _path(lora), tuple(p), merged) not in _PEFT_TOKENS
        ]
        if todo:
            for p, tokens in zip(todo, peft_greedy(base, _path(lora), todo, MAX_TOKENS, merged)):
                _PEFT_TOKENS[(base, _path(lora), tuple(p), merged)] = tokens
    return [_PEFT_TOKENS[(base, _path(lora), tuple(p), merged)] for p, lora in zip(prompts, loras)]


_PEFT_TOKENS: dict[tuple, list[int]] = {}


@pytest.fixture
def adapters(peft_adapter):
    """Three adapters of the tiny llama: every module (rank 4), attention only with rsLoRA
    (rank 8), two MLP modules (rank 2)."""
    attention = ("q_proj", "v_proj", "o_proj")
    return [
        LoRARequest("all", 1, peft_adapter("llama", rank=4, alpha=8.0, seed=1)),
        LoRARequest(
            "attn-rs",
            2,
            peft_adapter("llama", rank=8, alpha=4.0, use_rslora=True, seed=2, targets=attention),
        ),
        LoRARequest(
            "mlp", 3, peft_adapter("llama", rank=2, alpha=2.0, seed=3, targets=("gate_proj",))
        ),
    ]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_three_adapters_and_the_base_in_one_batch_match_peft(
    tiny_checkpoint, adapters, async_scheduling
):
    base = tiny_checkpoint("llama")
    a, b, c = adapters
    prompts = random_prompts([5, 12, 3, 9, 7, 4], seed=1)
    loras = [a, None, b, c, a, None]
    llm = make_llm(
        base,
        enable_lora=True,
        max_loras=3,
        max_lora_rank=8,
        num_kv_blocks=128,
        async_scheduling=async_scheduling,
    )
    got = _greedy(llm, prompts, loras)
    assert got == _expected(base, prompts, loras)
    assert got[:1] == _expected(base, prompts[:1], loras[:1], merged=True)
    assert len({tuple(t) for t in _greedy(llm, [prompts[0]] * 4, [None, *adapters])}) == 4
    assert sorted(llm.llm_engine.core.executor.runner.lora.slots) == [1, 2, 3]


def test_chunked_prefill_and_preemption_match_peft(tiny_checkpoint, adapters):
    """Prompt chunks of 7 tokens and a pool too small for every request at once; the adapters
    are loaded by a first call, so the schedule does not depend on the loader thread."""
    base = tiny_checkpoint("llama")
    prompts = random_prompts([23, 9, 14, 3, 11, 6], seed=3)
    loras = [adapters[0], None, adapters[1], adapters[2], adapters[0], adapters[1]]
    llm = make_llm(
        base,
        enable_lora=True,
        max_loras=3,
        max_lora_rank=8,
        num_kv_blocks=17,
        max_num_batched_tokens=7,
        enable_prefix_caching=False,
    )
    _greedy(llm, prompts[1:4], loras[1:4])
    assert _greedy(llm, prompts, loras) == _expected(base, prompts, loras)
    core = llm.llm_engine.core
    assert core.scheduler.num_preemptions > 0
    assert core.kv_cache_manager.usage == 0.0


def test_slot_and_host_cache_swaps_match_peft(tiny_checkpoint, adapters):
    """One device slot and two adapters in host memory for three adapters: admission waits for
    the slot, and slots and the host cache swap (least recently used first)."""
    base = tiny_checkpoint("llama")
    prompts = random_prompts([23, 9, 14, 3, 11, 6], seed=3)
    loras = [adapters[0], None, adapters[1], adapters[2], adapters[0], adapters[1]]
    llm = make_llm(base, enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=8)
    assert _greedy(llm, prompts, loras) == _expected(base, prompts, loras)
    core = llm.llm_engine.core
    assert len(core.loras.resident) <= 2 and len(core.executor.runner.lora.host) <= 2
    assert len(core.executor.runner.lora.slots) == 1


def test_prefix_hits_never_cross_adapters(tiny_checkpoint, adapters):
    base = tiny_checkpoint("llama")
    a, b, _ = adapters
    prompt = random_prompts([21], seed=5)[0]
    llm = make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=128)
    kv = llm.llm_engine.core.kv_cache_manager
    expected = _expected(base, [prompt] * 3, [a, b, None])
    assert _greedy(llm, [prompt], [a]) == expected[:1]
    hits = kv.prefix_cache_hits
    assert _greedy(llm, [prompt], [b]) == expected[1:2]
    assert _greedy(llm, [prompt], [None]) == expected[2:]
    assert kv.prefix_cache_hits == hits  # same tokens, other adapters: no hit
    assert _greedy(llm, [prompt, prompt], [b, a]) == expected[1::-1]
    assert kv.prefix_cache_hits - hits == 2 * 20  # each adapter hits its own blocks


@needs_interpreter
def test_triton_kernels_match_peft(tiny_checkpoint, peft_adapter):
    pytest.importorskip("triton")
    base = tiny_checkpoint("qwen3")
    a = LoRARequest("a", 1, peft_adapter("qwen3", rank=4, seed=4))
    b = LoRARequest("b", 2, peft_adapter("qwen3", rank=8, seed=5, targets=("k_proj", "up_proj")))
    prompts = random_prompts([6, 11, 2], seed=11)
    loras = [a, None, b]
    llm = make_llm(
        base,
        kernel_backend="triton",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        num_kv_blocks=64,
        max_num_batched_tokens=9,
    )
    runner = llm.llm_engine.core.executor.runner
    batch = runner.lora.batch
    assert batch.segments is not None and batch.fuses_gemv
    forwards, raised = [], batch.forward_seq.item()
    runner.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    assert _greedy(llm, prompts, loras) == _expected(base, prompts, loras)
    assert forwards and batch.forward_seq.item() - raised == len(forwards)  # once a forward


def test_speculative_decoding_verifies_drafts_with_each_adapter(tiny_checkpoint, adapters):
    """n-gram drafts are verified in one forward whose tokens carry their request's adapter."""
    base = tiny_checkpoint("llama")
    prompts = [p * 3 for p in random_prompts([5, 4, 6], seed=13)]  # repeats: n-gram matches
    loras = [adapters[0], None, adapters[1]]
    llm = make_llm(
        base,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        num_kv_blocks=128,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    assert _greedy(llm, prompts, loras) == _expected(base, prompts, loras)
    assert llm.llm_engine.stats().spec_num_drafts > 0


@pytest.mark.parametrize(
    ("arch", "targets"),
    [
        ("qwen2", ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj")),  # q/k/v biases
        ("gemma3", ("q_proj", "v_proj", "gate_proj", "down_proj")),  # sliding + global layers
        ("qwen3_moe", ("q_proj", "k_proj", "v_proj", "o_proj")),  # attention of a MoE model
        # The multimodal container: its language model's layers (not the vision tower's).
        ("gemma3_mm", r".*language_model.*\.(q_proj|k_proj|o_proj|up_proj|down_proj)"),
    ],
)
def test_other_families_match_peft(tiny_checkpoint, peft_adapter, arch, targets):
    base = tiny_checkpoint(arch)
    lora = LoRARequest("a", 1, peft_adapter(arch, rank=4, seed=6, targets=targets))
    prompts = random_prompts([7, 11], seed=17)
    loras = [lora, None]
    llm = make_llm(base, enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    assert _greedy(llm, prompts, loras) == _expected(base, prompts, loras)
