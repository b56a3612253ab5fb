"""Torch forms of the two LoRA ops over a batch whose tokens use different adapters (slot per
token, -1: none). shrink: t[i] = x[i] @ A[slot[i]]^T; expand: y[i] += t[i] @ B[slot[i]]^T (the
adapter's scaling is folded into B when it is loaded). `*_ref` loops over tokens on the host (the
obvious definition, for tests); the `lora_*_torch` forms are the CPU path: one GEMM over every
slot's A then a gather, and each token's B gathered (small steps) or one masked GEMM per slot,
with no host sync (CUDA-graph safe). `lora_expand_extended_torch` is the torch form of
`lora_expand.lora_expand_extended` (every slot's t already beside the base output)."""

from __future__ import annotations

import torch

# Values a gathered B may hold in `lora_expand_torch` (16 MiB in fp32).
GATHER_LIMIT = 1 << 22


def lora_shrink_ref(
    x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """x [T, K], lora_a [L, N, K], token_slots [T] -> [T, N] (zero rows where slot is -1)."""
    out = x.new_zeros(x.shape[0], lora_a.shape[1])
    for i, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            out[i] = (lora_a[slot].float() @ x[i].float()).to(x.dtype)
    return out


def lora_expand_ref(
    t: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor
) -> None:
    """y [T, N] += t [T, K] @ lora_b[slot] [N, K]^T per token, in place (rows with slot -1 kept)."""
    for i, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            y[i] += (lora_b[slot].float() @ t[i].float()).to(y.dtype)


def lora_shrink_torch(
    x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """`lora_shrink_ref` as one GEMM over every slot's A, then each token's slot gathered."""
    num_slots, n, k = lora_a.shape
    num_tokens = x.shape[0]
    every = x @ lora_a.reshape(num_slots * n, k).t()
    return pick_slot_columns(every, num_slots, token_slots[:num_tokens])


def pick_slot_columns(
    every: torch.Tensor, num_slots: int, token_slots: torch.Tensor
) -> torch.Tensor:
    """every [T, L * N] (every slot's N columns side by side) -> [T, N]: each token's slot's
    columns (zero for a token without an adapter)."""
    num_tokens = every.shape[0]
    n = every.shape[1] // num_slots
    every = every.reshape(num_tokens, num_slots, n)
    index = token_slots.clamp(min=0).long().view(num_tokens, 1, 1).expand(num_tokens, 1, n)
    picked = every.gather(1, index).squeeze(1)
    return picked * (token_slots >= 0).to(picked.dtype).unsqueeze(1)


def lora_expand_extended_torch(
    y_ext: torch.Tensor,
    n: int,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    slice_starts: tuple[int, ...] = (0,),
) -> torch.Tensor:
    """`lora_expand.lora_expand_extended` in torch: y_ext [T, N + L*S*R] -> y [T, N]."""
    num_tokens, num_slots = y_ext.shape[0], lora_b.shape[0]
    slots = token_slots[:num_tokens]
    t = pick_slot_columns(y_ext[:, n:], num_slots, slots)  # [T, S * R]
    y = y_ext[:, :n].contiguous()
    lora_expand_slices_torch(t, lora_b, slots, y, slice_starts)
    return y


def lora_expand_slices_torch(
    t: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    y: torch.Tensor,
    slice_starts: tuple[int, ...],
) -> None:
    """`lora_expand_torch` per shard of a merged layer: y's columns from slice_starts[j] on take
    t's j-th rank-wide block."""
    rank, bounds = lora_b.shape[2], (*slice_starts, y.shape[1])
    for j in range(len(slice_starts)):
        cols = slice(bounds[j], bounds[j + 1])
        lora_expand_torch(t[:, j * rank : (j + 1) * rank], lora_b[:, cols], token_slots, y[:, cols])


def lora_expand_torch(
    t: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    y: torch.Tensor,
    gather_limit: int = GATHER_LIMIT,
) -> None:
    """`lora_expand_ref`: each token's B gathered and one batched product when that copy holds at
    most `gather_limit` values (decode-sized steps), else one GEMM per slot over the tokens of
    that slot (others masked). The choice follows the shapes alone."""
    num_tokens, n = y.shape
    if num_tokens * n * lora_b.shape[2] <= gather_limit:
        b = lora_b[token_slots.clamp(min=0).long()]  # [T, N, K]
        delta = torch.bmm(b, t.unsqueeze(2)).squeeze(2)
        y += delta * (token_slots >= 0).to(delta.dtype).unsqueeze(1)
        return
    for slot in range(lora_b.shape[0]):
        mask = (token_slots == slot).to(t.dtype).unsqueeze(1)
        y += (t * mask) @ lora_b[slot].t()
