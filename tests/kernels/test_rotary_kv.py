from __future__ import annotations

import pytest
import torch

from ferrum.kernels.attention_ref import write_kv_cache_ref
from ferrum.kernels.rotary_kv import rotary_kv
from ferrum.kernels.rotary_kv_ref import compute_cos_sin, qk_norm_rope_ref, rope_ref

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def _qkv(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as strided views of one fused projection output, like a QKV linear produces."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = torch.randn(num_tokens, sum(sizes), generator=gen).to(device, dtype)
    q, k, v = qkv.split(sizes, dim=-1)
    return (
        q.view(num_tokens, num_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "use_norm", "gathered"),
    # 20 heads: three programs of query heads (8, 8 and 4 of 8), then the key program.
    [
        (4, 2, 32, True, False),
        (6, 3, 64, False, True),
        (2, 1, 48, True, False),
        (20, 4, 32, True, True),
    ],
)
def test_rotary_kv_matches_reference(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    use_norm: bool,
    gathered: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    num_tokens, block_size = 5, 8
    q, k, v = _qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device, seed=head_dim)
    gen = torch.Generator().manual_seed(0)
    q_w = (1 + 0.1 * torch.randn(head_dim, generator=gen)).to(device, dtype) if use_norm else None
    k_w = (1 + 0.1 * torch.randn(head_dim, generator=gen)).to(device, dtype) if use_norm else None
    # One [max_position, head_dim] cos|sin cache; the kernel reads its halves as strided views.
    cos_sin = torch.cat(compute_cos_sin(64, head_dim, 10000.0), dim=-1).to(device)
    cos_table, sin_table = cos_sin.chunk(2, dim=-1)
    positions = torch.tensor([0, 9, 63, 10, 31], dtype=torch.int64, device=device)
    cos, sin = cos_table[positions], sin_table[positions]
    slots = torch.tensor([3, -1, 20, 7, 12], dtype=torch.int64, device=device)
    cache = torch.zeros(2, 3, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)

    exp_q, exp_k = qk_norm_rope_ref(q, k, cos, sin, q_w, k_w, 1e-6)
    exp_cache = cache.clone()
    keep = slots >= 0
    write_kv_cache_ref(exp_k[keep], v[keep], exp_cache, slots[keep])

    if gathered:
        rotary_kv(q, k, v, cos, sin, cache, slots, None, q_w, k_w, 1e-6)
    else:
        rotary_kv(q, k, v, cos_table, sin_table, cache, slots, positions, q_w, k_w, 1e-6)
    torch.testing.assert_close(q, exp_q, **TOL[dtype])
    torch.testing.assert_close(k, exp_k, **TOL[dtype])
    # The cache holds exactly the rotated key the kernel wrote back, and v unchanged.
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    torch.testing.assert_close(flat[0, slots[keep]], k[keep], atol=0, rtol=0)
    torch.testing.assert_close(cache, exp_cache, **TOL[dtype])


def test_rope_ref_scores_depend_on_relative_position() -> None:
    gen = torch.Generator().manual_seed(1)
    cos, sin = compute_cos_sin(40, 16, 10000.0)
    q = torch.randn(1, 1, 16, generator=gen)
    k = torch.randn(1, 1, 16, generator=gen)
    torch.testing.assert_close(rope_ref(q, cos[:1], sin[:1]), q)
    scores = [
        (
            rope_ref(q, cos[p + 5 : p + 6], sin[p + 5 : p + 6])
            * rope_ref(k, cos[p : p + 1], sin[p : p + 1])
        )
        .sum()
        .item()
        for p in (0, 7, 30)
    ]
    assert scores == pytest.approx([scores[0]] * 3, rel=1e-4)


def test_validation_errors() -> None:
    q, k, v = _qkv(3, 4, 2, 16, torch.float32, torch.device("cpu"), seed=0)
    cos, sin = compute_cos_sin(8, 16, 10000.0)
    cache = torch.zeros(2, 2, 8, 2, 16)
    pos = torch.zeros(3, dtype=torch.int64)
    slots = torch.zeros(3, dtype=torch.int64)
    args = (q, k, v, cos, sin, cache, slots)
    with pytest.raises(ValueError, match="positions"):
        rotary_kv(*args, pos.int())
    with pytest.raises(ValueError, match="key"):
        rotary_kv(q, k[:2], *args[2:])
    with pytest.raises(ValueError, match="cos"):
        rotary_kv(*args[:3], cos.double(), *args[4:])
    with pytest.raises(ValueError, match="sin"):
        rotary_kv(*args[:4], torch.zeros(8, 4), *args[5:])
    with pytest.raises(ValueError, match="num_tokens"):
        rotary_kv(*args[:3], cos[:2], sin[:2], *args[5:])
    with pytest.raises(ValueError, match="kv_cache"):
        rotary_kv(*args[:5], torch.zeros(2, 2, 8, 4, 16), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_kv(*args[:6], slots[:2])
    with pytest.raises(ValueError, match="together"):
        rotary_kv(*args, q_norm_weight=torch.ones(16))
    with pytest.raises(ValueError, match="k_norm_weight"):
        rotary_kv(*args, q_norm_weight=torch.ones(16), k_norm_weight=torch.ones(8))
    with pytest.raises(ValueError, match="head_dim"):
        q3 = torch.zeros(3, 4, 15)
        rotary_kv(q3, q3[:, :2], q3[:, :2], cos, sin, cache, slots)
