"""`attention_backend` (FlashAttention-4 for long chunks): which layers the runner gives it
(`kernel_backend.attach_flash_attention`, a GPU and the package faked on the CPU), the errors
that name the field, and which steps a layer sends through it."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

from ferrum.device_config import DeviceConfig
from ferrum.engine.arg_utils import EngineArgs
from ferrum.errors import FieldError
from ferrum.kernels import flash_attn4
from ferrum.kernels.flash_attn4 import FlashAttention4
from ferrum.kernels.interface import torch_kernels
from ferrum.model_executor.attention_metadata import AttentionMetadata
from ferrum.model_executor.kernel_backend import attach_flash_attention
from ferrum.model_executor.layers.attention import Attention
from tests.kernels.test_flash_attn4 import flash_attn_varlen_stand_in

BF16 = torch.bfloat16
CUDA = torch.device("cuda")


def layers(head_dim: int = 128, count: int = 2) -> nn.Module:
    return nn.Sequential(*(Attention(4, head_dim, 2, 0.1, torch_kernels()) for _ in range(count)))


@pytest.fixture
def fake_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """An sm90 GPU with flash-attn-4 installed (the stand-in as its varlen function)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(flash_attn4, "load_flash_attn4", lambda: (flash_attn_varlen_stand_in, ""))


def attach(model: nn.Module, backend: str, device=CUDA, kv_dtype=BF16, **config) -> bool:  # noqa: ANN001
    device_config = DeviceConfig(attention_backend=backend, **config)
    return attach_flash_attention(model, device_config, device, "triton", BF16, kv_dtype)


@pytest.mark.usefixtures("fake_hopper")
@pytest.mark.parametrize("backend", ["auto", "FLASH_ATTN"])
def test_every_layer_takes_it_where_it_runs(backend: str) -> None:
    model = layers()
    assert attach(model, backend)
    assert all(isinstance(layer.flash_attention, FlashAttention4) for layer in model)


def test_sdpa_keeps_the_long_chunks_of_steps_it_does_not_take(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fresh chunk of SDPA's shortest length is short of FA4_MIN_PAIRS: a layer given
    FlashAttention-4 still sends such a step's long chunks through SDPA (the device check
    passed: this may run without a GPU)."""
    from ferrum.kernels.interface import triton_kernels
    from ferrum.kernels.sdpa_prefill import SDPA_PREFILL_MIN_TOKENS
    from ferrum.model_executor.layers import attention as attention_module

    n = SDPA_PREFILL_MIN_TOKENS
    assert not flash_attn4.flash_attention_step([0, n], [n])
    monkeypatch.setattr(attention_module, "sdpa_takes", lambda device, dtype, head_dim: True)
    layer = Attention(4, 16, 2, 0.25, triton_kernels())
    layer.bind_kv_cache(torch.zeros(2, 3, 16, 2, 16, dtype=BF16))
    layer.use_flash_attention(FlashAttention4(flash_attn_varlen_stand_in))
    assert layer.takes_sdpa_prefill()


@pytest.mark.usefixtures("fake_hopper")
@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ({"head_dim": 100}, "heads of 100"),
        ({"kv_dtype": torch.float8_e4m3fn}, "KV cache"),
        ({"device": torch.device("cpu")}, "CUDA device"),
        ({"batch_invariant": True}, "batch-invariant"),
    ],
)
def test_auto_falls_back_and_flash_attn_says_why(case: dict, reason: str) -> None:
    case = dict(case)
    head_dim = case.pop("head_dim", 128)
    model = layers(head_dim)
    assert not attach(model, "auto", **case)
    assert all(layer.flash_attention is None for layer in model)
    with pytest.raises(FieldError, match=reason) as error:
        attach(layers(head_dim), "FLASH_ATTN", **case)
    assert error.value.field == "attention_backend"


def test_without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(flash_attn4, "load_flash_attn4", lambda: (None, flash_attn4.NOT_INSTALLED))
    assert not attach(layers(), "auto")
    with pytest.raises(FieldError, match=r"pip install 'ferrum\[fa4\]'"):
        attach(layers(), "FLASH_ATTN")
    broken = (None, "is installed but does not load: libcute_dsl_runtime.so")
    monkeypatch.setattr(flash_attn4, "load_flash_attn4", lambda: broken)
    assert not attach(layers(), "auto")
    with pytest.raises(FieldError, match="does not load: libcute"):
        attach(layers(), "FLASH_ATTN")


@pytest.mark.usefixtures("fake_hopper")
def test_triton_attn_never_takes_it() -> None:
    model = layers()
    assert not attach(model, "TRITON_ATTN")
    assert all(layer.flash_attention is None for layer in model)


def test_config_and_flag() -> None:
    with pytest.raises(FieldError, match="attention_backend: must be one of") as error:
        DeviceConfig(attention_backend="flashinfer")
    assert error.value.field == "attention_backend"
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert parser.parse_args(["--attention-backend", "FLASH_ATTN"]).attention_backend == (
        "FLASH_ATTN"
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention-backend", "XFORMERS"])


def step(chunks: list[int], block: int) -> AttentionMetadata:
    """Fresh prompts of `chunks` tokens on consecutive blocks from block 1."""
    starts, tables, first = [0], [], 1
    for n in chunks:
        starts.append(starts[-1] + n)
        tables.append(list(range(first, first + -(-n // block))))
        first += len(tables[-1])
    width = max(len(t) for t in tables)
    slots = [t[p // block] * block + p % block for t, n in zip(tables, chunks) for p in range(n)]
    return AttentionMetadata(
        num_reqs=len(chunks),
        num_tokens=starts[-1],
        max_query_len=max(chunks),
        max_seq_len=max(chunks),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(chunks, dtype=torch.int32),
        block_tables=(torch.tensor([t + [0] * (width - len(t)) for t in tables]).int(),),
        slot_mapping=(torch.tensor(slots),),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(chunks),
    )


@pytest.mark.parametrize("marked", [True, False])
def test_layer_sends_marked_steps_through_it(marked: bool) -> None:
    """Only the steps metadata marks (`flash_attention_step`), and the output equals ferrum's
    own kernels' (a CPU layer given the stand-in directly)."""
    chunks = [70, 3, 1]
    torch.manual_seed(0)
    heads, kv_heads, dim, block = 2, 1, 16, 16
    seen = []

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(kwargs["max_seqlen_q"])
        return flash_attn_varlen_stand_in(*args, **kwargs)

    metadata = step(chunks, block)
    metadata.flash_attention_step = marked
    outputs = []
    for flash in (FlashAttention4(counting), None):
        layer = Attention(heads, dim, kv_heads, dim**-0.5, torch_kernels())
        num_blocks = 1 + sum(-(-n // block) for n in chunks)
        layer.bind_kv_cache(torch.zeros(2, num_blocks, block, kv_heads, dim))
        layer.use_flash_attention(flash)
        gen = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(metadata.num_tokens, h, dim, generator=gen) for h in (2, 1, 1))
        cos = torch.ones(metadata.num_tokens, dim // 2)
        outputs.append(layer(q, k, v, cos, torch.zeros_like(cos), metadata))
    assert seen == ([70] if marked else [])
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-4)
