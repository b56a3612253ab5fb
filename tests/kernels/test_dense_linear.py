"""Model-dtype linear layers on the Triton backend: the one-row GEMV on a GPU (the tuned or the
rule's tile), F.linear otherwise, and the same tokens end to end."""

from __future__ import annotations

import pytest
import torch

import ferrum.kernels.dense_linear as dense_linear_module
from ferrum.kernels.dense_linear import dense_linear, gemv_tile_for
from ferrum.kernels.gemv_config import GemvTile
from ferrum.kernels.gemv_rows import GemvRowsTile
from ferrum.model_executor.kernel_backend import load_kernels
from ferrum.model_executor.layers.linear import Linear
from ferrum.model_executor.layers.quantization import get_linear_method
from ferrum.model_executor.layers.quantization.dense import DenseLinearMethod

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# Triton runs CPU tensors only under the interpreter, which conftest turns on where CUDA is absent.
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors need the interpreter")


@pytest.fixture
def gemv_calls(monkeypatch) -> list[tuple[int, int]]:
    """Makes every shape take the GEMV and records the weight shape of each GEMV launch."""
    calls: list[tuple[int, int]] = []
    real_gemv = dense_linear_module.gemv

    def spy(x, weight, *args, **kwargs):
        calls.append(tuple(weight.shape))
        return real_gemv(x, weight, *args, **kwargs)

    every_shape = GemvTile(BLOCK_N=4, BLOCK_K=64)
    monkeypatch.setattr(dense_linear_module, "gemv_tile", lambda n, k, device: every_shape)
    monkeypatch.setattr(dense_linear_module, "gemv", spy)
    return calls


def test_unquantized_layers_take_the_dense_method_with_either_kernels() -> None:
    torch_method = get_linear_method(None, load_kernels("torch"), ["mlp.down_proj"])
    assert torch_method._linear is torch.nn.functional.linear
    method = get_linear_method(None, load_kernels("triton"), ["mlp.down_proj"])
    assert isinstance(method, DenseLinearMethod) and method._linear is dense_linear
    layer = Linear(16, 8, bias=True, quant_method=method)
    assert layer.weight.shape == (8, 16) and layer.bias is not None
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(3, 16)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_the_cpu_never_takes_the_gemv(gemv_calls) -> None:
    x, w = torch.randn(1, 16, dtype=torch.float16), torch.randn(8, 16, dtype=torch.float16)
    assert gemv_tile_for(x, w) is None
    torch.testing.assert_close(dense_linear(x, w), torch.nn.functional.linear(x, w))
    assert gemv_calls == []


@needs_cuda
def test_one_row_takes_the_gemv_and_more_rows_f_linear(gemv_calls) -> None:
    w = torch.randn(40, 96, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(40, device="cuda", dtype=torch.bfloat16)
    for shape in [(96,), (1, 96), (1, 1, 96), (2, 96)]:
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        got = dense_linear(x, w, b)
        expected = torch.nn.functional.linear(x.float(), w.float(), b.float())
        assert got.shape == (*shape[:-1], 40) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), expected, atol=0.1, rtol=2e-2)
    assert gemv_calls == [(40, 96)] * 3
    assert gemv_tile_for(torch.randn(1, 96, device="cuda"), w) is None  # fp32 x, bf16 W


@cpu_only
def test_few_row_dispatch_counts_rows_and_follows_the_table(monkeypatch) -> None:
    """On the CPU (the interpreter runs the kernel), with the operand check and the device
    faked: 2..MAX_ROWS rows of any leading shape look the table up with their row count and
    take gemv_rows where it lists W; other row counts and unlisted shapes take F.linear."""
    looked_up: list[tuple[int, int, int]] = []
    listed = GemvRowsTile(BLOCK_N=16, BLOCK_K=32, SPLIT_K=2)

    def table(n: int, k: int, rows: int, device: object) -> GemvRowsTile | None:
        looked_up.append((n, k, rows))
        return listed if n == 40 else None

    monkeypatch.setattr(dense_linear_module, "_triton_operands", lambda x, w: True)
    monkeypatch.setattr(dense_linear_module, "device_properties", lambda d: object())
    monkeypatch.setattr(dense_linear_module, "gemv_tile", lambda n, k, d: None)
    monkeypatch.setattr(dense_linear_module, "gemv_rows_tile", table)
    ran: list[int] = []
    real = dense_linear_module.gemv_rows
    monkeypatch.setattr(
        dense_linear_module, "gemv_rows", lambda x, *a: ran.append(x.shape[0]) or real(x, *a)
    )
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=gen, dtype=torch.float16)
    other = torch.randn(48, 96, generator=gen, dtype=torch.float16)
    most = dense_linear_module.MAX_ROWS
    for shape in [(1, 96), (2, 96), (3, 1, 96), (most, 96), (most + 1, 96)]:
        x = torch.randn(*shape, generator=gen, dtype=torch.float16)
        got = dense_linear(x, w)
        assert got.shape == (*shape[:-1], 40)
        torch.testing.assert_close(
            got.float(), torch.nn.functional.linear(x.float(), w.float()), atol=2e-2, rtol=1e-2
        )
        dense_linear(x, other)
    assert looked_up == [(40, 96, 2), (48, 96, 2), (40, 96, 3), (48, 96, 3)] + [
        (40, 96, most), (48, 96, most)
    ]  # fmt: skip
    assert ran == [2, 3, most]


@needs_cuda
def test_listed_few_row_shapes_take_the_few_row_kernel(monkeypatch) -> None:
    """2..MAX_ROWS rows take gemv_rows where the table lists the shape; more rows, and unlisted
    shapes, F.linear."""
    calls: list[int] = []
    real = dense_linear_module.gemv_rows

    def spy(x, weight, tile, bias=None):
        calls.append(x.shape[0])
        return real(x, weight, tile, bias)

    listed = GemvRowsTile(BLOCK_N=64, BLOCK_K=64, SPLIT_K=2)
    monkeypatch.setattr(
        dense_linear_module, "gemv_rows_tile", lambda n, k, rows, d: listed if n == 40 else None
    )
    monkeypatch.setattr(dense_linear_module, "gemv_rows", spy)
    w = torch.randn(40, 96, device="cuda", dtype=torch.bfloat16)
    other = torch.randn(48, 96, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(40, device="cuda", dtype=torch.bfloat16)
    most = dense_linear_module.MAX_ROWS
    for shape in [(2, 96), (3, 1, 96), (most, 96), (most + 1, 96)]:
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        got = dense_linear(x, w, b)
        expected = torch.nn.functional.linear(x.float(), w.float(), b.float())
        assert got.shape == (*shape[:-1], 40)
        torch.testing.assert_close(got.float(), expected, atol=0.1, rtol=2e-2)
        dense_linear(x, other)
    assert calls == [2, 3, most]


@needs_cuda
def test_batch_one_decode_through_the_gemv_keeps_the_tokens(
    tiny_checkpoint, gemv_calls, monkeypatch
) -> None:
    """Every projection of one-prompt decode steps runs the GEMV (captured in the batch-1 CUDA
    graph at start-up), and so does the LM head (outside the graphs, every step); the tokens are
    the F.linear engine's greedy choices after the same prefix.
    fp16 rounds the two differently, so a near-tie of the random tiny model may flip: a wrong
    GEMV agrees at chance level."""
    from tests.utils.tiny_llm import cuda_llm, greedy, random_prompts, teacher_forced_agreement

    path = tiny_checkpoint("qwen3")
    prompts = random_prompts([5, 9, 14, 22], seed=3)
    llm = cuda_llm(path, dtype="float16", num_kv_blocks=64)
    arch = llm.llm_engine.config.model_config.arch
    hidden, inter = arch.hidden_size, arch.intermediate_size
    assert {(2 * inter, hidden), (hidden, inter)} <= set(gemv_calls)  # warm-up and capture
    gemv_calls.clear()
    outputs = [greedy(llm, [p])[0] for p in prompts]
    assert (arch.vocab_size, hidden) in gemv_calls  # the LM head, while serving
    # The reference: F.linear everywhere.
    monkeypatch.setattr(dense_linear_module, "gemv_tile", lambda n, k, device: None)
    reference = cuda_llm(path, dtype="float16", num_kv_blocks=64)
    assert teacher_forced_agreement(reference, prompts, outputs) >= 0.9
