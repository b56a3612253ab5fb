"""The fp16/bf16 GEMV (one row a program, or several) against F.linear in fp32, and its tile
table's validation."""

from __future__ import annotations

import json

import pytest
import torch

from ferrum.kernels.gemv import gemv
from ferrum.kernels.gemv_config import (
    CONFIG_DIR,
    GemvTile,
    get_gemv_tiles,
    parse_tiles,
    save_gemv_tiles,
)

CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 runs only on CUDA")

# Odd N and K (ragged last tiles in both), an even K and several rows.
SHAPES = [(1, 37, 100), (1, 64, 256), (3, 50, 96), (2, 1, 33)]


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=CUDA_ONLY)])
@pytest.mark.parametrize("m, n, k", SHAPES + [(5, 37, 100)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows_per_program", [1, 4])
def test_matches_f_linear(device, dtype, m, n, k, bias, rows_per_program) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    got = gemv(x, w, block_n=8, block_k=32, bias=b, rows_per_program=rows_per_program)
    expected = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=1e-2)


def test_rejects_mismatched_operands() -> None:
    w = torch.zeros(8, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="x must be"):
        gemv(torch.zeros(1, 8, dtype=torch.float16), w, 8, 16)
    with pytest.raises(ValueError, match="x must be"):
        gemv(torch.zeros(1, 16, dtype=torch.float32), w, 8, 16)
    with pytest.raises(ValueError, match="weight must be"):
        gemv(torch.zeros(1, 16), torch.zeros(8, 16), 8, 16)
    with pytest.raises(ValueError, match="bias must be"):
        gemv(torch.zeros(1, 16, dtype=torch.float16), w, 8, 16, bias=torch.zeros(4))
    with pytest.raises(ValueError, match="BLOCK_K must be a power of two"):
        gemv(torch.zeros(1, 16, dtype=torch.float16), w, 8, 24)
    with pytest.raises(ValueError, match="rows_per_program"):
        gemv(torch.zeros(1, 16, dtype=torch.float16), w, 8, 16, rows_per_program=3)


def test_tile_file_round_trip_keeps_other_shapes_and_marks_losers_null(tmp_path) -> None:
    save_gemv_tiles("Some GPU", {(4096, 4096): GemvTile(8, 512), (8, 8): GemvTile(1, 8)}, tmp_path)
    path = save_gemv_tiles(
        "Some GPU", {(6144, 4096): GemvTile(16, 1024, 8, 3)}, tmp_path, drop=frozenset({(8, 8)})
    )
    assert path.name == "Some_GPU.json"
    tiles = parse_tiles(json.loads(path.read_text()), str(path))
    assert tiles == {
        (4096, 4096): GemvTile(8, 512),
        (6144, 4096): GemvTile(16, 1024, 8, 3),
        (8, 8): None,  # measured slower than cuBLAS: F.linear
    }


def test_the_shipped_tile_files_parse() -> None:
    files = sorted(CONFIG_DIR.glob("*.json"))
    assert files
    for path in files:
        assert parse_tiles(json.loads(path.read_text()), str(path))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_shipped_tile_of_this_gpu_matches_f_linear() -> None:
    tiles = get_gemv_tiles(torch.cuda.get_device_name())
    if not tiles:
        pytest.skip("no tile table for this GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for (n, k), tile in tiles.items():
        if tile is None:
            continue
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        got = gemv(x, w, tile.BLOCK_N, tile.BLOCK_K, tile.num_warps, tile.num_stages)
        expected = torch.nn.functional.linear(x.float(), w.float())
        torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=2e-2, msg=f"{n}x{k}")
        del w


@pytest.mark.parametrize(
    "data, message",
    [
        ({"4096x4096": {"BLOCK_N": 8, "BLOCK_K": 512}}, "must read N<rows>_K<columns>"),
        ({"N8_K8": {"BLOCK_N": 8, "BLOCK_K": 512, "BLOCK_M": 1}}, "keys must be among"),
        ({"N8_K8": {"BLOCK_N": 6, "BLOCK_K": 512}}, "BLOCK_N must be a power of two"),
        ({"N8_K8": {"BLOCK_N": 8}}, "BLOCK_K"),
        ([], "must be an object"),
    ],
)
def test_malformed_tile_files_name_the_entry(data, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_tiles(data, "gemv_configs/X.json")
