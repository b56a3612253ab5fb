import pytest

from ferrum.kernels.fused_moe_config import DEFAULT_GROUPED
from ferrum.kernels.fused_moe_rule import GROUPED_RULE_BUCKETS
from ferrum.model_executor.warm_up import MULTI_REQUESTS, run_warm_up_batches, warm_up_batches


def test_every_power_of_two_runs_at_both_parities_up_to_the_step_budget() -> None:
    batches = warm_up_batches(max_tokens=8192, block_size=16, num_blocks=10_000)
    totals = [sum(b) for b in batches]
    assert totals[:4] == [1, 2, 4, 3]
    assert len(totals) == len(set(totals))
    for k in range(1, 14):
        assert 2**k in totals and 2**k - 1 in totals
    assert max(totals) == 8192
    # Every fused-MoE token bucket up to the budget is run at its bound.
    assert all(bound in totals for bound in DEFAULT_GROUPED if bound <= 8192)
    assert all(bound in totals for bound in GROUPED_RULE_BUCKETS if bound <= 8192)


def test_large_batches_hold_several_requests_small_ones_one() -> None:
    for batch in warm_up_batches(max_tokens=2048, block_size=16, num_blocks=10_000):
        assert len(batch) == (1 if sum(batch) <= 128 else MULTI_REQUESTS)
        assert max(batch) - min(batch) <= 1
    single = warm_up_batches(max_tokens=512, block_size=16, num_blocks=10_000, max_requests=1)
    assert all(len(b) == 1 for b in single)


@pytest.mark.parametrize("num_blocks", [0, 1, 5, 64])
def test_batches_fit_the_kv_blocks_given(num_blocks: int) -> None:
    for batch in warm_up_batches(max_tokens=4096, block_size=16, num_blocks=num_blocks):
        assert sum(-(-n // 16) for n in batch) <= num_blocks


def test_the_batches_run_through_a_runner_and_leave_generation_unchanged(tiny_checkpoint) -> None:
    from ferrum import SamplingParams
    from tests.utils.tiny_llm import make_llm

    def engine():
        return make_llm(
            tiny_checkpoint("qwen3"),
            num_kv_blocks=80,
            max_model_len=256,
            max_num_batched_tokens=256,
            max_num_seqs=8,
        )

    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompt = [{"prompt_token_ids": [3, 4, 5, 6, 7]}]
    expected = engine().generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    # As at start-up: the warm-up forwards run before any request.
    llm = engine()
    forwards, max_tokens = run_warm_up_batches(llm.llm_engine.core.executor.runner, 80)
    # 1, 2, 4, 3, ..., 128, 127 tokens in one request; 256 and 255 in four.
    assert (forwards, max_tokens) == (16, 256)
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_fp8_models_compile_the_sdpa_rows_pass_at_start_up(monkeypatch) -> None:
    """A step with SDPA's prompts quantizes their attention output for an FP8 o_proj by the
    per-group pass, which no warm-up forward reaches: start-up runs it once per row width, in
    block-scaled FP8 models only, for layers that take SDPA and write rows."""
    from types import SimpleNamespace

    import torch

    from ferrum.kernels import fp8_quant
    from ferrum.kernels.interface import triton_kernels
    from ferrum.model_executor import warm_up
    from ferrum.model_executor.layers.attention import Attention

    calls = []
    monkeypatch.setattr(fp8_quant, "per_token_group_quant_fp8", lambda x: calls.append(x.shape))
    sdpa_layers = [Attention(4, 128, 2, 0.1, triton_kernels()) for _ in range(2)]
    narrow = Attention(4, 64, 2, 0.1, triton_kernels())  # heads of 64: no rows
    for layer in [*sdpa_layers, narrow]:
        monkeypatch.setattr(
            layer,
            "sdpa_prefill_shape",
            lambda layer=layer: (4, 2, layer.head_dim, 0.1, torch.float32, torch.device("cpu")),
        )
    model = torch.nn.ModuleList([*sdpa_layers, narrow])

    def runner(weight_scales):
        quant = None if weight_scales is None else SimpleNamespace(weight_scales=weight_scales)
        config = SimpleNamespace(model_config=SimpleNamespace(quant_config=quant))
        return SimpleNamespace(config=config, model=model)

    warm_up._warm_up_sdpa_fp8_rows(runner("block"))
    assert calls == [(2, 4 * 128)]  # one width, both layers
    calls.clear()
    warm_up._warm_up_sdpa_fp8_rows(runner(None))
    warm_up._warm_up_sdpa_fp8_rows(runner("channel"))
    assert calls == []


@pytest.mark.parametrize("cudnn_heads", [(4, 8), (4,)])
def test_sdpa_layers_build_their_plans_and_gather_once_a_shape(monkeypatch, cudnn_heads) -> None:
    """Each distinct SDPA shape builds its plans up to the bound given, and runs the gather of a
    chunk after a cached prefix over its first layer's cache; layers without SDPA run neither.
    A shape cuDNN does not take turns chunks after a prefix off for the whole model."""
    from types import SimpleNamespace

    import torch

    from ferrum.kernels.interface import torch_kernels, triton_kernels
    from ferrum.model_executor import warm_up
    from ferrum.model_executor.layers.attention import Attention

    plans, gathers = [], []
    monkeypatch.setattr(
        warm_up, "warm_up_sdpa_prefill", lambda *shape, max_tokens: plans.append(shape) or 3
    )
    monkeypatch.setattr(
        warm_up, "warm_up_cached_pack", lambda heads, cache: gathers.append((heads, cache))
    )
    monkeypatch.setattr(warm_up, "cudnn_takes", lambda heads, *shape: heads in cudnn_heads)
    layers = [Attention(4, 16, 2, 0.1, triton_kernels()) for _ in range(2)]
    layers.append(Attention(8, 16, 2, 0.1, triton_kernels()))
    layers.append(Attention(4, 16, 2, 0.1, torch_kernels()))  # the torch references: no SDPA
    caches = [torch.zeros(2, 3, 16, 2, 16) for _ in layers]
    for layer, cache in zip(layers, caches):
        layer.bind_kv_cache(cache)
        monkeypatch.setattr(
            layer,
            "sdpa_prefill_shape",
            lambda layer=layer: (
                (layer.num_heads, 2, 16, 0.1, torch.float32, torch.device("cpu"))
                if layer.kernels.is_triton
                else None
            ),
        )
    disabled = []
    runner = SimpleNamespace(
        model=torch.nn.ModuleList(layers), disable_sdpa_after_prefixes=lambda: disabled.append(1)
    )
    assert warm_up._warm_up_sdpa_prefill(runner, 4096) == 6
    assert [shape[0] for shape in plans] == [4, 8]
    assert len(gathers) == 2
    assert [(heads, cache is caches[i]) for (heads, cache), i in zip(gathers, (0, 2))] == [
        (4, True),
        (8, True),
    ]
    assert disabled == ([] if 8 in cudnn_heads else [1])


def test_the_runner_bounds_sdpa_contexts_by_the_budget_and_the_model_length(tiny_checkpoint):
    from tests.utils.tiny_llm import make_llm

    def bound(max_model_len: int, budget: int) -> int:
        llm = make_llm(
            tiny_checkpoint("qwen3"),
            num_kv_blocks=40,
            max_model_len=max_model_len,
            max_num_batched_tokens=budget,
        )
        return llm.llm_engine.core.executor.runner.inputs.sdpa_max_len

    assert (bound(128, 256), bound(256, 192)) == (128, 192)
