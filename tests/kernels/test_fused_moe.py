"""Triton fused MoE (small-batch and grouped paths) and its token->expert align op against the
torch references."""

from __future__ import annotations

import pytest
import torch

import ferrum.kernels.fused_moe as fused_moe_module
import ferrum.kernels.moe_align as moe_align_module
from ferrum.kernels.arrival_counters import arrival_counters
from ferrum.kernels.fused_moe import SMALL_BATCH_MAX_TOKENS, fused_moe, get_config
from ferrum.kernels.fused_moe_ref import fused_moe_ref, select_experts
from ferrum.kernels.moe_align import max_num_blocks, moe_align_block_size
from ferrum.kernels.moe_align_ref import moe_align_block_size_ref
from ferrum.kernels.moe_router import moe_router
from ferrum.model_executor.kernel_backend import load_kernels
from ferrum.model_executor.layers.fused_moe import FusedMoE

TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
# small_batch_max_tokens forcing each path whatever the token count.
PATHS = {"small": 1 << 30, "grouped": 0}
# Small-path tiles below every test dim, so that the K loops run several (ragged) steps.
NARROW_SMALL_CONFIG = {
    "GATE_UP_BLOCK_N": 8,
    "GATE_UP_BLOCK_K": 16,
    "DOWN_BLOCK_E": 4,
    "DOWN_BLOCK_N": 8,
    "DOWN_BLOCK_K": 16,
    "num_warps": 4,
    "num_stages": 2,
}


def make_problem(num_tokens, hidden, inter, num_experts, top_k, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * 0.2
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    return x.to(device, dtype), w13.to(device, dtype), w2.to(device, dtype), logits.to(device)


def check(x, w13, w2, weights, ids, path, config=None, small_config=None) -> None:
    out = fused_moe(
        x,
        w13,
        w2,
        weights,
        ids,
        config=config,
        small_config=small_config,
        small_batch_max_tokens=PATHS[path],
    )
    assert out.shape == x.shape and out.dtype == x.dtype
    expected = fused_moe_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[x.dtype])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("num_tokens", "renormalize"), [(1, True), (3, False), (11, True)])
def test_matches_reference(path, num_tokens, renormalize, dtype, device) -> None:
    x, w13, w2, logits = make_problem(num_tokens, 64, 32, 5, 2, dtype, device, seed=num_tokens)
    weights, ids = select_experts(logits, 2, renormalize)
    check(x, w13, w2, weights, ids, path)


def test_down_tiles_over_choices_sum_the_choices_in_order(device) -> None:
    # Each w2 row holds one power of two and the top-k weights are powers of two, so every
    # weighted expert output is exact (fused multiply-add or not); weights of 2^24, 1 and -2^24
    # make the fp32 sum over choices depend on its order. Tiles of 1, 2 (7 = 2 + 2 + 2 + 1
    # choices) and 8 choices, and the choices split over programs then summed, must give the
    # same bits; ids -1 and >= E add nothing.
    num_tokens, hidden, inter, num_experts, top_k = 2, 32, 16, 9, 7
    x, w13, _, _ = make_problem(
        num_tokens, hidden, inter, num_experts, top_k, torch.float32, device
    )
    w2 = torch.zeros(num_experts, hidden, inter)
    w2[:, torch.arange(hidden), torch.arange(hidden) % inter] = 2.0 ** torch.arange(-3, 6).view(
        -1, 1
    )
    w2 = w2.to(device)
    ids = torch.tensor([[0, 3, 5, -1, 8, 2, 7], [1, 4, 9, 6, 0, 3, 2]], device=device)
    big = 2.0**24
    weights = torch.tensor([[big, 1.0, -big, 4.0, 0.5, big, -big]] * 2, device=device)
    outs = [
        fused_moe(
            x,
            w13,
            w2,
            weights,
            ids,
            small_config=NARROW_SMALL_CONFIG | down,
            small_batch_max_tokens=PATHS["small"],
        )  # fmt: skip
        for down in (
            {"DOWN_BLOCK_E": 1},
            {"DOWN_BLOCK_E": 2},
            {"DOWN_BLOCK_E": 8},
            {"DOWN_BLOCK_E": 1, "DOWN_SPLIT": 1},
        )  # fmt: skip
    ]
    assert all(torch.equal(outs[0], out) for out in outs[1:])
    expected = fused_moe_ref(
        x, w13, w2, weights.masked_fill((ids < 0) | (ids >= num_experts), 0.0),
        ids.clamp(0, num_experts - 1),
    )  # fmt: skip
    torch.testing.assert_close(outs[0], expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_down_split_over_choices_matches_reference(num_tokens, dtype, device) -> None:
    x, w13, w2, logits = make_problem(num_tokens, 64, 32, 5, 3, dtype, device, seed=7)
    weights, ids = select_experts(logits, 3, True)
    split = NARROW_SMALL_CONFIG | {"DOWN_SPLIT": 1, "DOWN_BLOCK_E": 1}
    check(x, w13, w2, weights, ids, "small", small_config=split)
    # Each output tile's last arrival reset its counter for the next launch.
    assert not arrival_counters(x.device, num_tokens * 8, "test").any()


@pytest.mark.parametrize("path", PATHS)
def test_pairs_of_experts_held_elsewhere_contribute_zero(path, dtype, device) -> None:
    # Expert parallelism: ids of other ranks' experts arrive as -1 and add nothing.
    x, w13, w2, logits = make_problem(6, 64, 32, 4, 2, dtype, device, seed=9)
    weights, ids = select_experts(logits, 2, True)
    ids[0, 0] = ids[3, 1] = ids[4, 0] = ids[4, 1] = -1
    out = fused_moe(x, w13, w2, weights, ids, small_batch_max_tokens=PATHS[path])
    expected = fused_moe_ref(x, w13, w2, weights.masked_fill(ids < 0, 0.0), ids.clamp(min=0))
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[x.dtype])
    assert torch.all(out[4] == 0)


@pytest.mark.parametrize("path", PATHS)
def test_odd_dims_int32_ids_and_ragged_k(path, dtype, device) -> None:
    # H = 40 and I = 24 are not powers of two nor multiples of the 16-wide K tiles; 7 tokens
    # * 3 choices over 3 M-blocks in the grouped path.
    x, w13, w2, logits = make_problem(7, 40, 24, 6, 3, dtype, device, seed=4)
    weights, ids = moe_router(logits, 3, True)
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2}
    check(x, w13, w2, weights, ids, path, config=config, small_config=NARROW_SMALL_CONFIG)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("top_k", [1, 7])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_top_k_extremes_and_id_dtypes(path, top_k, id_dtype, device) -> None:
    # E = 7 is not a power of two; top_k = 7 routes every token to every expert.
    x, w13, w2, logits = make_problem(3, 48, 24, 7, top_k, torch.float32, device, seed=top_k)
    weights, ids = select_experts(logits, top_k, False)
    check(x, w13, w2, weights, ids.to(id_dtype), path)


@pytest.mark.parametrize("path", PATHS)
def test_unused_experts_are_never_read(path, dtype, device) -> None:
    x, w13, w2, _ = make_problem(5, 64, 32, 6, 2, dtype, device, seed=2)
    gen = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.tensor([1, 4])[torch.randperm(2, generator=gen)] for _ in range(5)])
    weights = torch.rand(5, 2, generator=gen)
    ids, weights = ids.to(device), weights.to(device)
    expected = fused_moe_ref(x, w13, w2, weights, ids)
    for e in (0, 2, 3, 5):
        w13[e] = float("nan")
        w2[e] = float("nan")
    out = fused_moe(x, w13, w2, weights, ids, small_batch_max_tokens=PATHS[path])
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])


def test_all_tokens_on_one_expert(dtype, device) -> None:
    # 20 pairs on expert 3 span two 16-row M-blocks, the second one part padding.
    x, w13, w2, _ = make_problem(20, 64, 32, 5, 1, dtype, device, seed=6)
    ids = torch.full((20, 1), 3, device=device)
    weights = torch.rand(20, 1, generator=torch.Generator().manual_seed(1)).to(device)
    config = dict(get_config(20), BLOCK_M=16)
    check(x, w13, w2, weights, ids, "grouped", config=config)


@pytest.mark.parametrize(
    ("num_tokens", "kwargs", "expected"),
    [
        (SMALL_BATCH_MAX_TOKENS, {}, "small"),
        (SMALL_BATCH_MAX_TOKENS + 1, {}, "grouped"),
        (1, {"config": get_config(1)}, "grouped"),
        (2, {"config": get_config(2), "small_batch_max_tokens": 2}, "small"),
        (3, {"small_batch_max_tokens": 2}, "grouped"),
    ],
)
def test_path_choice(monkeypatch, num_tokens, kwargs, expected) -> None:
    calls = []
    monkeypatch.setattr(fused_moe_module, "small_batch_moe", lambda *a: calls.append("small"))
    monkeypatch.setattr(fused_moe_module, "_grouped_moe", lambda *a: calls.append("grouped"))
    x, w13, w2, logits = make_problem(num_tokens, 16, 16, 4, 2, torch.float32, "cpu")
    weights, ids = select_experts(logits, 2, False)
    fused_moe(x, w13, w2, weights, ids, **kwargs)
    assert calls == [expected]


def test_no_tokens(device) -> None:
    x, w13, w2, logits = make_problem(0, 64, 32, 5, 2, torch.float32, device)
    weights, ids = select_experts(logits, 2, False)
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.shape == (0, 64)


def test_align_exact(device) -> None:
    # Pairs: 0:(t0,e2) 1:(t0,e0) 2:(t1,e2) 3:(t1,e3) 4:(t2,e0) 5:(t2,e2); sentinel 6.
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=device)
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids, num_experts=5, block_m=4)
    s = 6
    assert sorted_ids.tolist() == [1, 4, s, s, 0, 2, 5, s, 3, s, s, s] + [s] * 12
    assert expert_ids.tolist() == [0, 2, 3, -1, -1, -1]
    assert num_post.tolist() == [12]
    assert sorted_ids.dtype == expert_ids.dtype == num_post.dtype == torch.int32


def test_align_static_bound_is_tight_enough(device) -> None:
    # Every pair on its own expert: each of the min(E, pairs) groups takes one whole block.
    ids = torch.arange(8, device=device).view(4, 2)
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids, num_experts=128, block_m=16)
    assert max_num_blocks(8, 128, 16) == 8 == expert_ids.numel()
    assert expert_ids.tolist() == list(range(8)) and num_post.tolist() == [128]
    assert sorted_ids.view(8, 16)[:, 0].tolist() == list(range(8))


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_experts", "block_m", "max_spans"),
    [
        (1, 8, 128, 16, 256),
        (13, 3, 6, 4, 256),
        (21, 1, 3, 1, 256),
        # 300 pairs = 5 chunks of 64 over 3 spans of 2 chunks, the last span ragged.
        (100, 3, 5, 16, 3),
        (150, 2, 128, 16, 2),
    ],
)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_align_matches_reference(
    monkeypatch, num_tokens, top_k, num_experts, block_m, max_spans, id_dtype, device
) -> None:
    monkeypatch.setattr(moe_align_module, "_MAX_SPANS", max_spans)
    gen = torch.Generator().manual_seed(num_tokens)
    # Skewed ids: a few experts take most pairs, some take none.
    ids = (torch.rand(num_tokens, top_k, generator=gen) ** 3 * num_experts).long()
    ids = ids.to(device, id_dtype)
    got = moe_align_block_size(ids, num_experts, block_m)
    expected = moe_align_block_size_ref(ids, num_experts, block_m)
    for name, g, e in zip(("sorted_pair_ids", "expert_ids", "num_post_padded"), got, expected):
        assert g.dtype == torch.int32, name
        assert torch.equal(g, e), name


def test_align_leaves_out_ids_out_of_range(device) -> None:
    ids = torch.tensor([[1, -1], [3, 1]], device=device)  # pair 1 (-1) and pair 2 (3 >= E)
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids, num_experts=3, block_m=2)
    assert sorted_ids.tolist()[:2] == [0, 3] and set(sorted_ids.tolist()[2:]) == {4}
    assert expert_ids.tolist() == [1, -1, -1, -1] and num_post.tolist() == [2]


@pytest.mark.parametrize(
    ("ids", "num_experts", "block_m", "match"),
    [
        (torch.zeros(4, dtype=torch.int32), 4, 16, "topk_ids"),
        (torch.zeros(2, 2), 4, 16, "topk_ids"),
        (torch.zeros(2, 2, dtype=torch.int32), 0, 16, "num_experts"),
        (torch.zeros(2, 2, dtype=torch.int32), 4, 0, "block_m"),
    ],
)
def test_align_bad_input(ids, num_experts, block_m, match) -> None:
    with pytest.raises(ValueError, match=match):
        moe_align_block_size(ids, num_experts, block_m)


def test_layer_built_with_triton_matches_torch(device) -> None:
    x, w13, w2, logits = make_problem(3, 64, 32, 5, 2, torch.float32, device, seed=8)
    outputs = []
    for backend in ("torch", "triton"):
        layer = FusedMoE(
            num_experts=5,
            top_k=2,
            hidden_size=64,
            intermediate_size=32,
            renormalize=True,
            hidden_act="silu",
            kernels=load_kernels(backend),
        )
        layer.w13.data, layer.w2.data = w13, w2
        outputs.append(layer(x, logits))
        assert layer._router is (select_experts if backend == "torch" else moe_router)
    torch.testing.assert_close(outputs[1], outputs[0], **TOLERANCE[torch.float32])


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("w13", lambda p: p.update(w13=p["w13"][:, :-1])),
        ("w2", lambda p: p.update(w2=p["w2"].half())),
        ("topk_weights", lambda p: p.update(topk_weights=p["topk_weights"].double())),
        ("topk_ids", lambda p: p.update(topk_ids=p["topk_ids"].float())),
        ("hidden", lambda p: p.update(hidden=p["hidden"][0])),
    ],
)
def test_bad_input_names_the_field(field, change) -> None:
    x, w13, w2, logits = make_problem(2, 64, 32, 5, 2, torch.float32, "cpu")
    weights, ids = select_experts(logits, 2, False)
    args = {"hidden": x, "w13": w13, "w2": w2, "topk_weights": weights, "topk_ids": ids}
    change(args)
    with pytest.raises(ValueError, match=field):
        fused_moe(**args)


@pytest.mark.parametrize(
    "kernel, unspecialised",
    [
        (moe_align_module._moe_align_count_kernel, moe_align_module.COUNT_RUNTIME_INTS),
        (moe_align_module._moe_align_scatter_kernel, moe_align_module.SCATTER_RUNTIME_INTS),
    ],
)
def test_align_kernels_leave_every_runtime_integer_unspecialised(kernel, unspecialised) -> None:
    # No variant may depend on the step's token count, which most of them follow: specialised,
    # an arbitrary count could need a variant the start-up warm-up never compiled.
    import inspect

    params = inspect.signature(kernel.fn).parameters.values()
    runtime_ints = {
        p.name
        for p in params
        if not p.name.endswith("_ptr") and "constexpr" not in str(p.annotation)
    }
    assert runtime_ints == set(unspecialised)
    if hasattr(kernel, "params"):  # compiled: the JIT function's own flags
        assert {p.name for p in kernel.params if p.do_not_specialize} == runtime_ints
    else:  # the interpreter keeps the decorator's arguments
        assert set(kernel.kwargs["do_not_specialize"]) == runtime_ints
