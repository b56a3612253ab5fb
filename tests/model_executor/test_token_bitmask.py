"""apply_token_bitmask_ equals its torch definition; unconstrained rows stay untouched; tokens
are forbidden in a row unless they are all it allows."""

from __future__ import annotations

import pytest
import torch

from ferrum.model_executor.token_bitmask import (
    allocate_token_bitmask,
    allow_all_tokens,
    apply_token_bitmask_,
    apply_token_bitmask_reference,
    forbid_tokens_unless_only_ones,
)
from ferrum.structured_output import bitmask_width


def test_width_rounds_up_to_whole_words():
    assert [bitmask_width(v) for v in (1, 32, 33, 151_936)] == [1, 1, 2, 4748]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab_size", [77, 128, 8262])
def test_kernel_matches_reference_with_mixed_rows(dtype, vocab_size):
    generator = torch.Generator().manual_seed(vocab_size)
    num_rows = 5
    bitmask = allocate_token_bitmask(num_rows, vocab_size)
    random_words = torch.randint(
        -(2**31), 2**31, (num_rows, bitmask_width(vocab_size)), generator=generator
    ).to(torch.int32)
    constrained_rows = [0, 3]
    bitmask[constrained_rows] = random_words[constrained_rows]
    bitmask[3, 0] = 1 << 5  # row 3's first word allows token 5 only
    logits = torch.randn(num_rows, vocab_size, generator=generator).to(dtype)

    expected = apply_token_bitmask_reference(logits, bitmask)
    apply_token_bitmask_(logits, bitmask)

    assert torch.equal(logits, expected)
    free_rows = [1, 2, 4]
    assert torch.isfinite(logits[free_rows]).all()
    assert torch.isinf(logits[constrained_rows]).any(dim=1).all()
    assert torch.isfinite(logits[3, :32]).nonzero().flatten().tolist() == [5]


def test_reference_reads_the_documented_bit_layout():
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = -(2**31)  # bit 31: token 31
    bitmask[0, 1] = 0b101  # tokens 32 and 34
    masked = apply_token_bitmask_reference(torch.zeros(1, 40), bitmask)
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [31, 32, 34]


def test_allow_all_tokens_clears_a_row():
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    allow_all_tokens(bitmask, 1)
    assert bitmask[0].eq(0).all() and bitmask[1].eq(-1).all()


def test_shape_mismatches_are_value_errors():
    logits = torch.zeros(2, 100)
    with pytest.raises(ValueError, match="bitmask has 1 rows but logits have 2"):
        apply_token_bitmask_(logits, allocate_token_bitmask(1, 100))
    with pytest.raises(ValueError, match="need 4"):
        apply_token_bitmask_(logits, allocate_token_bitmask(2, 64))
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask_(logits, torch.zeros(2, 4, dtype=torch.int64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernel_matches_reference():
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31, (8, bitmask_width(151_936)), generator=generator)
    bitmask = bitmask.to(torch.int32)
    bitmask[2] = -1
    logits = torch.randn(8, 151_936, generator=generator).to(torch.bfloat16)
    expected = apply_token_bitmask_reference(logits, bitmask)
    logits_gpu, bitmask_gpu = logits.cuda(), bitmask.cuda()
    apply_token_bitmask_(logits_gpu, bitmask_gpu)
    assert torch.equal(logits_gpu.cpu(), expected)


def _allowed(bitmask: torch.Tensor, row: int, vocab_size: int) -> list[int]:
    logits = torch.zeros(1, vocab_size)
    masked = apply_token_bitmask_reference(logits, bitmask[row : row + 1])
    return torch.nonzero(masked[0] == 0).flatten().tolist()


def test_forbidding_tokens_keeps_a_row_that_allows_nothing_else():
    vocab_size = 70
    bitmask = allocate_token_bitmask(2, vocab_size)
    bitmask.zero_()
    for token_id in (3, 31, 64):  # bit 31: the sign bit of its word
        bitmask[0, token_id // 32] |= torch.tensor(1, dtype=torch.int32) << (token_id % 32)
    bitmask[1] = bitmask[0]
    assert forbid_tokens_unless_only_ones(bitmask, 0, [31, 64, 999])
    assert _allowed(bitmask, 0, vocab_size) == [3]
    # The row would be empty without them: it is left as it was.
    assert not forbid_tokens_unless_only_ones(bitmask, 1, [3, 31, 64])
    assert _allowed(bitmask, 1, vocab_size) == [3, 31, 64]
