"""FP8 checkpoints (Qwen's block-scaled "fp8" and compressed-tensors per-channel) and on-the-fly
`quantization="fp8"` against transformers on tiny fp32 models (CPU, torch reference GEMMs).

Exact reference: transformers runs the dequantized twin (weights = fp8 codes * scales) with each
projection's input rounded to FP8 as W8A8 does (per token-group of 128 / per token). That is the
arithmetic the FP8 engine performs, so logits agree to fp32 rounding (but where fp32's other order
of operations puts an activation on the other side of an FP8 rounding boundary: see
_flipped_positions) and greedy tokens are equal.
Against the unquantized model only a loose bound holds (see test_close_to_the_unquantized_model).
"""

from __future__ import annotations

import pytest
import torch

from tests.utils.fp8_checkpoints import (
    fake_quantize_activations,
    write_dequantized_twin,
    write_fp8_checkpoint,
)
from tests.utils.model_step import Seq, load, prompt, run_step
from tests.utils.tiny_checkpoints import hf_logits, load_hf_model
from tests.utils.tiny_llm import (
    MAX_TOKENS,
    cuda_llm,
    greedy,
    make_llm,
    random_prompts,
    teacher_forced_agreement,
)

# Every projection's input size is a multiple of 128 and the merged q|k|v and gate|up shards
# start on 128-row boundaries (q 256, k 128, v 128; gate 256, up 256), as in real Qwen3/Llama.
FP8_SHAPES = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 64}
# MoE experts are FP8 weight-only (no activation rounding); their sizes are multiples of 128.
ARCH_SHAPES = {"qwen3_moe": {**FP8_SHAPES, "moe_intermediate_size": 128}}
# One activation an FP8 step away from the reference's (see _flipped_positions).
FLIP_TOLERANCE = 5e-3
# Activation group of each format: 128 columns for block scales, the whole row for per-channel.
GROUP = {"fp8": 128, "compressed-tensors": None}


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_checkpoint, tmp_path_factory):
    """(arch, fmt) -> (source dir, fp8 dir, hooked HF reference model), built once each."""
    built: dict[tuple[str, str], tuple[str, str, torch.nn.Module]] = {}

    def build(arch: str, fmt: str) -> tuple[str, str, torch.nn.Module]:
        if (arch, fmt) not in built:
            source = tiny_checkpoint(arch, **ARCH_SHAPES.get(arch, FP8_SHAPES))
            root = tmp_path_factory.mktemp(f"{arch}-{fmt}")
            fp8_dir = write_fp8_checkpoint(source, str(root / "fp8"), fmt)
            twin = write_dequantized_twin(fp8_dir, str(root / "twin"))
            reference = fake_quantize_activations(load_hf_model(twin), GROUP[fmt])
            built[arch, fmt] = (source, fp8_dir, reference)
        return built[arch, fmt]

    return build


def _flipped_positions(logits: torch.Tensor, expected: torch.Tensor) -> int:
    """Positions whose logits are off the reference's by more than fp32 rounding (relative L2
    1e-5), each within FLIP_TOLERANCE: both sides compute the activations in fp32 in another
    order, so a value can land on the other side of an FP8 rounding boundary; its code then
    differs by one step, which moves that position's logits by ~1e-3. A wrong scale, block or
    rounding rule moves every position by 1e-1 or more."""
    assert logits.shape == expected.shape
    rel = (logits - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert rel.max().item() <= FLIP_TOLERANCE, rel.tolist()
    return int((rel > 1e-5).sum())


@pytest.mark.parametrize(
    ("arch", "fmt"),
    [
        *((arch, fmt) for arch in ("qwen3", "llama", "qwen2") for fmt in GROUP),
        ("qwen3_moe", "fp8"),
        ("mistral_sw", "fp8"),
        ("gemma3", "compressed-tensors"),
    ],
)
def test_prefill_and_decode_logits_match_dequantized_reference(fp8_checkpoint, arch, fmt) -> None:
    _, fp8_dir, reference = fp8_checkpoint(arch, fmt)
    _, model = load(fp8_dir)
    seqs = [Seq(prompt(7, 3), [5, 2], 7), Seq(prompt(13, 90), [9, 1, 12, 4], 13)]
    flips = []
    for seq, logits in zip(seqs, run_step(model, seqs)):
        flips.append(_flipped_positions(logits, hf_logits(reference, seq.token_ids)))
        seq.token_ids = seq.token_ids + [int(logits[-1].argmax())]
        seq.num_new = 1
    for i, (seq, logits) in enumerate(zip(seqs, run_step(model, seqs))):
        flips[i] += _flipped_positions(logits, hf_logits(reference, seq.token_ids)[-1:])
    assert max(flips) <= 1, flips  # at most one position of a sequence is a step off


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors"])
def test_llm_generates_the_reference_greedy_tokens(fp8_checkpoint, fmt) -> None:
    _, fp8_dir, reference = fp8_checkpoint("qwen3", fmt)
    prompts = random_prompts([5, 17], seed=3)
    expected = []
    for ids in prompts:
        ids = list(ids)
        for _ in range(MAX_TOKENS):
            ids.append(int(hf_logits(reference, ids)[-1].argmax()))
        expected.append(ids[-MAX_TOKENS:])
    assert greedy(make_llm(fp8_dir), prompts) == expected


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_quantization_fp8_equals_the_fp8_checkpoint(fp8_checkpoint, arch) -> None:
    """On-the-fly 128x128 quantization of the source gives the checkpoint's codes and scales
    bit for bit (same recipe), hence the same greedy tokens through LLM."""
    source, fp8_dir, _ = fp8_checkpoint(arch, "fp8")
    online = dict(load(source, quantization="fp8")[1].named_parameters())
    stored = dict(load(fp8_dir)[1].named_parameters())
    assert online.keys() == stored.keys()
    assert "model.layers.0.self_attn.qkv_proj.weight_scale_inv" in online
    if arch == "qwen3_moe":
        assert online["model.layers.0.mlp.experts.w13"].dtype == torch.float8_e4m3fn
        assert online["model.layers.0.mlp.experts.w2_scale"].shape == (8, 1, 1)
        assert online["model.layers.0.mlp.gate.weight"].dtype == torch.float32
    for name, param in online.items():
        assert param.dtype == stored[name].dtype, name
        assert torch.equal(param.view(torch.uint8), stored[name].view(torch.uint8)), name
    prompts = random_prompts([6, 11], seed=5)
    assert greedy(make_llm(source, quantization="fp8"), prompts) == greedy(
        make_llm(fp8_dir), prompts
    )


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors"])
def test_close_to_the_unquantized_model(fp8_checkpoint, fmt) -> None:
    """e4m3 keeps 3 mantissa bits: each weight and activation is rounded by up to 2^-4 of its
    value (about 3.6% RMS), so each GEMM output moves by about 5% RMS, and the random tiny
    model (no training to make it robust) amplifies that over its 14 GEMMs: measured relative
    L2 errors of the logits are 0.13-0.23 for these models. Bound 0.35: a model with other
    random weights is at about 1.4, so this still tells the quantized model from a wrong one."""
    source, fp8_dir, _ = fp8_checkpoint("qwen3", fmt)
    _, model = load(fp8_dir)
    token_ids = prompt(24, 11)
    [logits] = run_step(model, [Seq(token_ids, list(range(1, 8)), len(token_ids))])
    expected = hf_logits(load_hf_model(source), token_ids)
    assert ((logits - expected).norm() / expected.norm()).item() < 0.35
    agree = (logits.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agree >= 0.7


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the FP8 kernels run on CUDA")
@pytest.mark.parametrize(
    ("arch", "fmt"), [("qwen3", "fp8"), ("qwen3", "compressed-tensors"), ("qwen3_moe", "fp8")]
)
def test_cuda_fp8_greedy_tokens_are_the_twins_choice(fp8_checkpoint, tmp_path, arch, fmt):
    """The FP8 engine on CUDA (cuBLASLt / Triton FP8 GEMMs for a batch of 32, the decode GEMV one
    prompt at a time, FP8 experts, CUDA graphs, bf16) against the bf16 twin holding the same
    dequantized weights: most generated tokens are the twin's own greedy choice after the same
    prefix. A tiny random model has near-tied logits, and W8A8 rounds each activation by up to
    2^-4, so the twin's choice is not always kept (the CPU test against the unquantized model
    bounds the same agreement at 0.7 in fp32); a wrong scale, layout or kernel agrees with it at
    chance level, a few percent. The figures are printed (-s) for the record."""
    _, fp8_dir, _ = fp8_checkpoint(arch, fmt)
    twin_dir = write_dequantized_twin(fp8_dir, str(tmp_path / "twin"))
    prompts = random_prompts([5, 9, 13, 17, 21, 25, 29, 33] * 4, seed=11)
    fp8 = cuda_llm(fp8_dir, dtype="bfloat16", num_kv_blocks=128, max_num_seqs=32)
    twin = cuda_llm(twin_dir, dtype="bfloat16", num_kv_blocks=128, max_num_seqs=32)
    for name, outputs in (
        ("a batch of 32", greedy(fp8, prompts)),
        ("one prompt at a time", [greedy(fp8, [p])[0] for p in prompts]),
    ):
        agree = teacher_forced_agreement(twin, prompts, outputs)
        print(f"{arch} {fmt}, {name}: {agree:.0%} of the tokens are the bf16 twin's choice")
        assert agree >= 0.5, name
