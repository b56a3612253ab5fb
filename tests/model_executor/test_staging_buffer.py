from __future__ import annotations

import pytest
import torch

from ferrum.model_executor.staging_buffer import StagingBuffer, staging_bytes

CPU = torch.device("cpu")


def test_staging_bytes_rounds_each_array_to_64() -> None:
    assert staging_bytes((1, torch.int64), (3, torch.int32), (0, torch.bool)) == 128
    assert staging_bytes((16, torch.float32)) == 64


def test_take_lays_out_aligned_arrays_and_copy_makes_them_visible() -> None:
    staging = StagingBuffer(staging_bytes((3, torch.int64), (5, torch.int32)), CPU)
    staging.begin()
    ids_np, ids = staging.take(3, torch.int64)
    lens_np, lens = staging.take(5, torch.int32)
    ids_np[:] = [7, 8, 9]
    lens_np[:] = range(5)
    staging.copy()
    assert ids.tolist() == [7, 8, 9] and ids.dtype == torch.int64
    assert lens.tolist() == [0, 1, 2, 3, 4] and lens.dtype == torch.int32
    assert (lens.data_ptr() - ids.data_ptr()) % 64 == 0 and lens.data_ptr() != ids.data_ptr()


def test_sets_alternate_so_the_previous_step_stays_intact() -> None:
    staging = StagingBuffer(64, CPU)
    staging.begin()
    first_np, first = staging.take(2, torch.int64)
    first_np[:] = [1, 2]
    staging.copy()
    staging.begin()
    second_np, _ = staging.take(2, torch.int64)
    second_np[:] = [3, 4]
    staging.copy()
    assert first.tolist() == [1, 2]


def test_take_past_capacity_raises() -> None:
    staging = StagingBuffer(64, CPU)
    staging.begin()
    staging.take(8, torch.int64)
    with pytest.raises(ValueError, match="64-byte staging buffer"):
        staging.take(1, torch.int64)
