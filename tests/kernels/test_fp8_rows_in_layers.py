"""FP8 rows from the norms, the attention and SiLU-and-mul reach the FP8 layers that read them.

On CUDA the block-scaled layers whose bucket quantizes in a separate pass read the rows the
RMSNorm, attention or SiLU-and-mul before them wrote (`takes_fp8_rows`). The CPU has no such
bucket, so here the layers are told to take rows and each call checks that the rows it got are
its input's quantization.
"""

from __future__ import annotations

import pytest
import torch

from ferrum.config import ModelConfig
from ferrum.kernels.fp8_quant import per_token_group_quant_fp8
from ferrum.model_executor.layers.quantization.fp8 import Fp8LinearMethod
from ferrum.model_executor.model_loader import load_model
from tests.utils.model_step import CPU, Seq, new_kv_caches, run_step

# Heads of 128: each is one quantization group of o_proj's input, so the attention writes rows.
SHAPES = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 128}


def _logits(source: str) -> list[torch.Tensor]:
    config = ModelConfig(source, quantization="fp8", dtype="float16")
    model = load_model(config, CPU, kernel_backend="triton")
    model.bind_kv_caches([cache.half() for cache in new_kv_caches(config)])
    seqs = [Seq([5, 9, 2, 7, 1], [1, 2], 5), Seq([3, 4, 8], [3], 3)]
    return run_step(model, seqs)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="drives the kernels on the CPU under the interpreter"
)
def test_rows_reach_every_projection(tiny_checkpoint, monkeypatch):
    source = tiny_checkpoint("qwen3", **SHAPES)
    expected = _logits(source)
    original_apply = Fp8LinearMethod.apply
    took: list[str] = []

    def apply(self, layer, x, bias, x_fp8=None):
        if x_fp8 is not None:
            q, scales = per_token_group_quant_fp8(x.reshape(-1, x.shape[-1]))
            assert torch.equal(x_fp8.q.view(torch.uint8), q.view(torch.uint8)), self.layer_name
            assert torch.equal(x_fp8.scales, scales), self.layer_name
            took.append(self.layer_name.split("/")[0].rsplit(".", 1)[-1])
        return original_apply(self, layer, x, bias, x_fp8)

    monkeypatch.setattr(Fp8LinearMethod, "takes_fp8_rows", lambda self, layer, x: True)
    monkeypatch.setattr(Fp8LinearMethod, "apply", apply)
    got = _logits(source)
    num_layers = ModelConfig(source).num_hidden_layers
    assert sorted(took) == sorted(["q_proj", "o_proj", "gate_proj", "down_proj"] * num_layers)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_attention_writes_rows_only_with_heads_of_128() -> None:
    """One quantization group of o_proj's input a head: heads of 64 would need two heads a
    group, so those layers write no rows (o_proj quantizes itself); the torch reference path
    writes none either."""
    from ferrum.kernels.interface import torch_kernels, triton_kernels
    from ferrum.model_executor.layers.attention import Attention

    kernels = triton_kernels()
    assert Attention(2, 128, 1, 0.1, kernels).writes_fp8_rows()
    assert not Attention(2, 64, 1, 0.1, kernels).writes_fp8_rows()
    assert not Attention(2, 128, 1, 0.1, torch_kernels()).writes_fp8_rows()
