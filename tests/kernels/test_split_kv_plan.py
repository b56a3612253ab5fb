from __future__ import annotations

import pytest

from ferrum.kernels.paged_attention_common import (
    SPLIT_KV_FP8_FACTOR,
    SPLIT_KV_MAX_PROGRAMS,
    SPLIT_KV_MIN_SEQ_LEN,
    split_kv_max_programs,
)
from ferrum.kernels.split_kv_plan import (
    allocate_split_kv_workspace,
    default_num_splits,
    split_kv_workspace_shapes,
    use_split_kv,
)


def test_use_split_kv_heuristic() -> None:
    ws = allocate_split_kv_workspace(8, 4, 32, "cpu")
    assert use_split_kv(4, 4, 2, 1, 2048, ws)
    assert use_split_kv(4, 4, 2, 1, SPLIT_KV_MIN_SEQ_LEN + 1, ws)
    assert not use_split_kv(4, 4, 2, 1, SPLIT_KV_MIN_SEQ_LEN, ws)  # one pass is as fast
    assert not use_split_kv(4, 5, 2, 2, 2048, ws)  # not decode-only
    assert not use_split_kv(9, 9, 2, 1, 2048, ws)  # more requests than the workspace holds
    assert not use_split_kv(4, 4, 2, 1, 2048, None)
    many = allocate_split_kv_workspace(SPLIT_KV_MAX_PROGRAMS, 4, 32, "cpu", max_splits=1)
    assert not use_split_kv(SPLIT_KV_MAX_PROGRAMS, SPLIT_KV_MAX_PROGRAMS, 1, 1, 2048, many)


def test_fp8_caches_split_into_more_programs() -> None:
    """32 requests x 8 KV heads fill 256 single-pass programs: one pass over a bf16 cache, split
    over an FP8 one (its programs do more work per byte), into 4x the parts."""
    ws = allocate_split_kv_workspace(128, 32, 128, "cpu")
    assert not use_split_kv(32, 32, 8, 1, 8192, ws)
    assert use_split_kv(32, 32, 8, 1, 8192, ws, fp8_cache=True)
    assert not use_split_kv(128, 128, 8, 1, 8192, ws, fp8_cache=True)  # 1,024 programs
    assert split_kv_max_programs(True) == SPLIT_KV_FP8_FACTOR * split_kv_max_programs(False)
    assert default_num_splits(16, 8, 32, fp8_cache=True) == 4 * default_num_splits(16, 8, 32)


def test_default_num_splits_fills_the_gpu() -> None:
    assert default_num_splits(1, 4, 32) == 32  # batch 1 of a 4-KV-head model: 128 programs
    assert default_num_splits(8, 8, 32) == 8  # 64 programs -> 512
    assert default_num_splits(100, 8, 32) == 1
    assert default_num_splits(1, 1, 4) == 4  # capped by the workspace


def test_split_kv_workspace_shapes() -> None:
    assert split_kv_workspace_shapes(3, 8, 64, 16) == ((3, 8, 16, 64), (3, 8, 16))
    with pytest.raises(ValueError, match="max_splits"):
        split_kv_workspace_shapes(3, 8, 64, 0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        split_kv_workspace_shapes(0, 8, 64)
