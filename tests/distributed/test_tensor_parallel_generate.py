"""Two ranks (gloo processes) each run their shard of every architecture through the runner and
a scheduler: the greedy tokens equal tp=1's, and both ranks sample the same tokens (a seeded
sampled request included), with chunked prefill, prefix-cache hits and preemptions."""

from __future__ import annotations

import pytest

from tests.utils.eagle3_heads import head_config, random_head_tensors, write_head
from tests.utils.fp8_checkpoints import write_fp8_checkpoint
from tests.utils.int4_checkpoints import write_int4_checkpoint
from tests.utils.tp_generate import generate, generate_on_rank

# (tiny checkpoint arch, its config overrides, ParallelConfig fields)
CASES = {
    "llama-sharded-checkpoint": ("llama", {}, {}),
    "qwen2-tied-odd-vocab": ("qwen2", {"vocab_size": 383}, {}),
    "qwen3-one-kv-head": ("qwen3", {"num_key_value_heads": 1}, {}),
    "mistral-sliding-window": ("mistral_sw", {}, {}),
    "gemma3": ("gemma3", {}, {}),
    "qwen3_moe": ("qwen3_moe", {}, {}),
    "qwen3_moe-expert-parallel": ("qwen3_moe", {}, {"enable_expert_parallel": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_generate_what_one_does(gloo_ranks, tiny_checkpoint, case) -> None:
    arch, overrides, parallel = CASES[case]
    path = tiny_checkpoint(arch, **overrides)
    expected = generate(path)
    assert expected["num_preemptions"] > 0 and expected["prefix_cache_hits"] > 0
    rank0, rank1 = gloo_ranks.run(generate_on_rank, path, parallel)
    assert rank0 == rank1
    # Greedy requests are exact; the seeded sampled one only has to agree between the ranks.
    assert rank0["tokens"][:-1] == expected["tokens"][:-1]
    assert rank0["num_preemptions"] == expected["num_preemptions"]
    assert rank0["prefix_cache_hits"] == expected["prefix_cache_hits"]


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_two_ranks_speculate_like_one_rank_without_speculation(
    gloo_ranks, tiny_checkpoint, method, tmp_path
) -> None:
    """Every rank proposes the same drafts (n-gram from the same tokens; the draft model and
    the EAGLE-3 head whole on each rank, the head over the target's vocab-split embedding) and
    accepts the same ones: greedy tokens equal tp=1's without speculation."""
    path = tiny_checkpoint("qwen3")
    spec = {"method": method, "num_speculative_tokens": 3, "disable_by_batch_size": None}
    if method == "draft_model":
        spec["model"] = path  # its own draft: every draft is accepted
    if method == "eagle3":
        config = head_config(eagle_aux_hidden_state_layer_ids=[1, 0, 1])
        spec["model"] = write_head(tmp_path, config, random_head_tensors(config, 2))
    expected = generate(path)
    rank0, rank1 = gloo_ranks.run(generate_on_rank, path, {}, False, spec)
    assert rank0 == rank1
    # The seeded request too: it draws once per output token, with speculation or without.
    assert rank0["tokens"] == expected["tokens"]
    if method == "draft_model":
        assert rank0["accepted_drafts"] > 0


FP8_SHAPES = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 64}
FP8_CASES = {
    "qwen3": ("qwen3", {"num_key_value_heads": 4}, {}),
    "qwen3_moe": ("qwen3_moe", {"num_key_value_heads": 4, "moe_intermediate_size": 256}, {}),
    "qwen3_moe-expert-parallel": (
        "qwen3_moe",
        {"num_key_value_heads": 4, "moe_intermediate_size": 128},
        {"enable_expert_parallel": True},
    ),
}


@pytest.mark.parametrize("case", list(FP8_CASES))
def test_two_ranks_generate_what_one_does_with_fp8(
    gloo_ranks, tiny_checkpoint, tmp_path, case
) -> None:
    """Qwen's block-FP8 format split over two ranks: every rank's share of each weight and of
    its activation (input columns of o_proj and down_proj) is a whole number of 128-blocks, so
    the scales split on block boundaries and the W8A8 arithmetic is that of one rank."""
    arch, overrides, parallel = FP8_CASES[case]
    source = tiny_checkpoint(arch, **FP8_SHAPES, **overrides)
    path = write_fp8_checkpoint(source, str(tmp_path / "fp8"), "fp8")
    expected = generate(path)
    rank0, rank1 = gloo_ranks.run(generate_on_rank, path, parallel)
    assert rank0 == rank1
    assert rank0["tokens"][:-1] == expected["tokens"][:-1]


@pytest.mark.parametrize(
    ("arch", "fmt", "group", "parallel"),
    [
        ("qwen3", "gptq", 16, {}),
        ("qwen3", "gptq-act-order", 16, {}),
        ("qwen3", "awq", 16, {}),
        ("qwen3", "ct", -1, {}),
        ("qwen3_moe", "gptq", 16, {}),
        ("qwen3_moe", "awq", 16, {"enable_expert_parallel": True}),
    ],
)
def test_two_ranks_generate_what_one_does_with_int4(
    gloo_ranks, tiny_checkpoint, tmp_path, arch, fmt, group, parallel
):
    """Int4 layers split over two ranks: column-parallel shares split the packed words by output
    rows; row-parallel ones (o_proj, down_proj) by input columns on group boundaries (a
    per-channel scale is whole on every rank; with act-order, g_idx splits with the columns and
    every rank holds every group's scales); experts by intermediate columns, or whole."""
    act_order = fmt.endswith("-act-order")
    fmt = fmt.removesuffix("-act-order")
    path, _ = write_int4_checkpoint(
        tiny_checkpoint(arch),
        str(tmp_path / fmt),
        fmt,
        group,
        sym=not act_order,
        act_order=act_order,
    )
    expected = generate(path)
    rank0, rank1 = gloo_ranks.run(generate_on_rank, path, parallel)
    assert rank0 == rank1
    assert rank0["tokens"][:-1] == expected["tokens"][:-1]
