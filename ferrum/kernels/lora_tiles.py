"""Triton helpers shared by the LoRA shrink and expand: which token block of which adapter slot a
program handles, and that block's batch rows. A step's tokens, grouped by slot
(`LoRASegments`), split into blocks of BLOCK_M per slot, numbered slot by slot; there are at most
cdiv(num_tokens, BLOCK_M) + num_slots of them whatever the mix, so a grid of that many programs
along one axis covers any step (CUDA graphs replay any mix) with few idle programs."""

from __future__ import annotations

import triton
import triton.language as tl


def max_token_blocks(num_tokens: int, block_m: int, num_slots: int) -> int:
    """Programs along the token-block axis: enough for any split of the tokens over the slots."""
    return triton.cdiv(num_tokens, block_m) + num_slots


@triton.jit
def slot_block(count_ptr, block, num_slots, SLOTS_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    """(slot, block index within that slot's tokens) of the step's `block`-th token block; slot
    is `num_slots` when `block` is past the last one."""
    idx = tl.arange(0, SLOTS_P2)
    counts = tl.load(count_ptr + idx, mask=idx < num_slots, other=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(blocks, 0)
    slot = tl.sum((ends <= block).to(tl.int32), 0)
    first = tl.sum(tl.where(idx == slot, ends - blocks, 0), 0)
    return slot, block - first


@triton.jit
def slot_rows(sorted_ptr, start_ptr, slot, offs_m, count):
    """The batch rows (int64) at positions `offs_m` of a slot's sorted tokens, and their mask
    (positions past the slot's `count` tokens: row 0, masked)."""
    mask_m = offs_m < count
    start = tl.load(start_ptr + slot)
    rows = tl.load(sorted_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    return rows, mask_m
