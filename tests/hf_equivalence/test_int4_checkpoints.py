"""Int4 checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized) against transformers running
their dequantized twin (tiny fp32 models, CPU, the torch reference product).

The twin's weights are exactly what the checkpoint means ((code - zero) * fp16 scale is exact in
fp32), so the logits agree to fp32 rounding: relative L2 1e-5 per position (a wrong nibble order,
zero offset, group or g_idx moves them by 1e-1 or more). Formats that cannot load say why."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ferrum import LLM
from tests.utils.int4_checkpoints import write_int4_checkpoint
from tests.utils.model_step import Seq, load, prompt, run_step
from tests.utils.tiny_checkpoints import hf_greedy, hf_logits, load_hf_model
from tests.utils.tiny_llm import (
    MAX_TOKENS,
    greedy,
    make_llm,
    random_prompts,
    teacher_forced_agreement,
)

# (format, group size, symmetric, act-order)
CASES = {
    "gptq-sym-g32": ("gptq", 32, True, False),
    "gptq-asym-act-order-g16": ("gptq", 16, False, True),
    "gptq-per-channel": ("gptq", -1, True, False),
    "awq-g32": ("awq", 32, False, False),
    "ct-g16": ("ct", 16, True, False),
    "ct-act-order-g32": ("ct", 32, True, True),
}


@pytest.fixture(scope="module")
def int4_checkpoint(tiny_checkpoint, tmp_path_factory):  # noqa: ANN001, ANN201
    built: dict[tuple[str, str], tuple[str, str]] = {}

    def build(case: str, arch: str = "qwen3") -> tuple[str, str]:
        if (case, arch) not in built:
            fmt, group, sym, act_order = CASES[case]
            root = tmp_path_factory.mktemp(f"{arch}-{case}")
            built[case, arch] = write_int4_checkpoint(
                tiny_checkpoint(arch), str(root / "int4"), fmt, group, sym, act_order
            )
        return built[case, arch]

    return build


def assert_close_to_fp32_rounding(logits: torch.Tensor, expected: torch.Tensor) -> None:
    rel = (logits - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert rel.max().item() <= 1e-5, rel.tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_decode_logits_match_the_dequantized_twin(int4_checkpoint, case) -> None:  # noqa: ANN001
    int4_dir, twin = int4_checkpoint(case)
    reference = load_hf_model(twin)
    _, model = load(int4_dir)
    seqs = [Seq(prompt(7, 3), [5, 2], 7), Seq(prompt(13, 90), [9, 1, 12, 4], 13)]
    for seq, logits in zip(seqs, run_step(model, seqs)):
        assert_close_to_fp32_rounding(logits, hf_logits(reference, seq.token_ids))
        seq.token_ids = seq.token_ids + [int(logits[-1].argmax())]
        seq.num_new = 1
    for seq, logits in zip(seqs, run_step(model, seqs)):
        assert_close_to_fp32_rounding(logits, hf_logits(reference, seq.token_ids)[-1:])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_other_architectures_load_gptq(int4_checkpoint, arch) -> None:  # noqa: ANN001
    int4_dir, twin = int4_checkpoint("gptq-sym-g32", arch)
    _, model = load(int4_dir)
    seq = Seq(prompt(9, 4), [3, 1, 2], 9)
    assert_close_to_fp32_rounding(run_step(model, [seq])[0], hf_logits(twin, seq.token_ids))


def test_llm_generates_the_twins_greedy_tokens(int4_checkpoint) -> None:  # noqa: ANN001
    int4_dir, twin = int4_checkpoint("awq-g32")
    prompts = random_prompts([5, 17], seed=3)
    assert greedy(make_llm(int4_dir), prompts) == hf_greedy(twin, prompts, MAX_TOKENS)


def test_the_triton_kernel_in_the_interpreter_generates_the_same_tokens(int4_checkpoint) -> None:  # noqa: ANN001
    int4_dir, _ = int4_checkpoint("gptq-asym-act-order-g16")
    prompts = random_prompts([6, 11], seed=4)
    torch_path = greedy(make_llm(int4_dir), prompts)
    assert greedy(make_llm(int4_dir, kernel_backend="triton"), prompts) == torch_path


def edited(int4_dir: str, tmp_path, **changes: object) -> str:  # noqa: ANN001
    path = os.path.join(int4_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"].update(changes)
    folder = tmp_path / "edited"
    folder.mkdir(exist_ok=True)
    for name in os.listdir(int4_dir):
        if name != "config.json":
            (folder / name).symlink_to(os.path.join(int4_dir, name))
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize(
    ("case", "changes", "message"),
    [
        ("gptq-sym-g32", {"bits": 8}, "quantization_config.bits: 8 bits are not supported yet"),
        ("gptq-sym-g32", {"lm_head": True}, "quantized lm_head is not supported yet"),
        ("awq-g32", {"version": "gemv"}, "quantization_config.version: 'gemv'"),
        ("gptq-sym-g32", {"group_size": 0}, "group_size: must be a positive integer or -1"),
        ("gptq-asym-act-order-g16", {"desc_act": False}, "g_idx permutes the input columns"),
    ],
)
def test_unsupported_or_inconsistent_checkpoints_are_refused(
    int4_checkpoint,
    tmp_path,
    case,
    changes,
    message,  # noqa: ANN001
) -> None:
    folder = edited(int4_checkpoint(case)[0], tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        LLM(folder, skip_tokenizer_init=True, dtype="float32", device="cpu", num_kv_blocks=16)


@pytest.mark.parametrize("case", ["gptq-sym-g32", "awq-g32", "ct-g16"])
def test_int4_experts_dequantized_at_load_match_the_twin(int4_checkpoint, case) -> None:  # noqa: ANN001
    int4_dir, twin = int4_checkpoint(case, "qwen3_moe")
    _, model = load(int4_dir)
    assert model.model.layers[0].mlp.experts.w13.dtype == torch.float32
    seq = Seq(prompt(9, 4), [3, 1, 2], 9)
    assert_close_to_fp32_rounding(run_step(model, [seq])[0], hf_logits(twin, seq.token_ids))


def test_int4_act_order_experts_are_refused(int4_checkpoint) -> None:  # noqa: ANN001
    int4_dir, _ = int4_checkpoint("gptq-asym-act-order-g16", "qwen3_moe")
    with pytest.raises(ValueError, match="quantization: int4 act-order experts"):
        make_llm(int4_dir)


@pytest.mark.parametrize(
    ("case", "changes"),
    [
        ("gptq-sym-g32", {}),
        ("gptq-asym-act-order-g16", {}),
        ("gptq-per-channel", {"desc_act": True}),
    ],
)
def test_dummy_weights_in_the_int4_layout(int4_checkpoint, tmp_path, case, changes) -> None:  # noqa: ANN001
    # Act-order layers keep the identity grouping (dummy weights must not overwrite g_idx).
    llm = make_llm(edited(int4_checkpoint(case)[0], tmp_path, **changes), load_format="dummy")
    assert len(greedy(llm, [[1, 2, 3]])[0]) == MAX_TOKENS


def test_compressed_tensors_weight_actorder_has_no_g_idx(int4_checkpoint, tmp_path) -> None:  # noqa: ANN001
    """actorder "weight" keeps the groups contiguous: no weight_g_idx (shardable as usual)."""
    int4_dir, twin = int4_checkpoint("ct-g16")
    path = os.path.join(int4_dir, "config.json")
    with open(path) as f:
        groups = json.load(f)["quantization_config"]["config_groups"]
    groups["group_0"]["weights"]["actorder"] = "weight"
    _, model = load(edited(int4_dir, tmp_path, config_groups=groups))
    seq = Seq(prompt(9, 4), [3, 1, 2], 9)
    assert_close_to_fp32_rounding(run_step(model, [seq])[0], hf_logits(twin, seq.token_ids))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["gptq-asym-act-order-g16", "awq-g32", "ct-g16"])
def test_the_triton_kernel_on_cuda_matches_the_twin(int4_checkpoint, case) -> None:  # noqa: ANN001
    """The compiled kernel in fp16 against the twin in fp32 on the CPU (what transformers gives,
    above): nearly every generated token is the twin's most likely one."""
    int4_dir, twin = int4_checkpoint(case)
    prompts = random_prompts([7, 30], seed=6)
    llm = LLM(int4_dir, skip_tokenizer_init=True, dtype="float16", device="cuda",
              max_model_len=128, num_kv_blocks=64)  # fmt: skip
    assert teacher_forced_agreement(make_llm(twin), prompts, greedy(llm, prompts)) >= 0.9
