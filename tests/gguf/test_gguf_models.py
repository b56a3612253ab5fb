"""GGUF files of tiny Llama, Qwen2 (q/k/v biases, tied embeddings), Qwen3 and Qwen3-MoE
checkpoints (F32, F16, BF16, Q8_0, Q4_K, Q5_K and Q6_K tensors mixed, as llama.cpp's K-quant
files mix them; Llama 3's RoPE scaling as the `rope_freqs` tensor) load through `LLM` and score
prompts as transformers scores their dequantized twins: the same float32 values, so logprobs
agree within 1e-4 (float32 arithmetic in a different order)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ferrum import LLM, SamplingParams
from ferrum.default_model import DEFAULT_MODEL_DIR
from ferrum.engine.tokenizer import Tokenizer
from ferrum.gguf.rope import ROPE_FREQS
from tests.utils.gguf_files import llama3_rope_divisors, write_gguf
from tests.utils.tiny_checkpoints import hf_logits, load_hf_model
from tests.utils.tiny_llm import random_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TOLERANCE = 1e-4
VOCAB = 8192  # the shipped tokenizer's, which the files carry
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
# Matrices whose rows are too short for K-quants cycle through the other types.
OTHER_TYPES = ("Q8_0", "F16", "BF16", "Q8_0", "F32")
# tests/utils/tiny_checkpoints.py arch -> (GGUF architecture, config overrides): rows of 256
# (the intermediate sizes) take K-quant blocks; three layers give each K-quant one.
ARCHS = {
    "qwen3": ("qwen3", {"num_hidden_layers": 3}),
    "llama": ("llama", {"num_hidden_layers": 3}),
    "llama3": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3_moe": ("qwen3moe", {"moe_intermediate_size": 256}),
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _types(name: str, shape: tuple[int, ...]) -> str:
    """A type per tensor: norms F32, 256-wide rows a K-quant by layer, others cycling."""
    if len(shape) == 1:
        return "F32"
    layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
    if shape[-1] % 256 == 0:
        return K_QUANTS[layer % len(K_QUANTS)]
    return OTHER_TYPES[(layer + sum(map(ord, name))) % len(OTHER_TYPES)]


@pytest.fixture(scope="module")
def gguf_models(tiny_checkpoint, tmp_path_factory) -> dict[str, tuple[str, str]]:
    """arch -> (GGUF file, its twin's folder)."""
    root = tmp_path_factory.mktemp("gguf_models")
    built = {}
    for arch, (gguf_arch, overrides) in ARCHS.items():
        hf_dir = tiny_checkpoint(arch, vocab_size=VOCAB, intermediate_size=256, **overrides)
        tokenizer = {
            "dir": DEFAULT_MODEL_DIR,
            "pre": "gpt-2",
            "ids": {"eos": 2, "padding": 0},
            "chat_template": CHAT_TEMPLATE,
        }
        extra = {ROPE_FREQS: llama3_rope_divisors(hf_dir)} if arch == "llama3" else None
        built[arch] = write_gguf(hf_dir, Path(root) / arch, gguf_arch, _types, tokenizer, extra)
    return built


def _llm(path: str) -> LLM:
    return LLM(path, dtype="float32", device="cpu", block_size=4, max_model_len=128)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_prompt_logprobs_match_the_dequantized_twin(gguf_models, arch: str) -> None:
    path, twin = gguf_models[arch]
    llm = _llm(path)
    model = load_hf_model(twin)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    prompts = random_prompts([19, 7], seed=5, vocab=VOCAB)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    worst = 0.0
    for prompt, output in zip(prompts, outputs):
        reference = hf_logits(model, prompt).log_softmax(dim=-1)
        for position in range(1, len(prompt)):
            token = prompt[position]
            got = output.prompt_logprobs[position][token].logprob
            worst = max(worst, abs(got - float(reference[position - 1, token])))
    assert worst < TOLERANCE


def test_text_in_text_out_and_chat(gguf_models) -> None:
    """The file's tokenizer and chat template serve text prompts and chat."""
    llm = _llm(gguf_models["qwen3"][0])
    source = Tokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    text = "To create a new table, 12345 tables!"
    output = llm.generate(text, params, use_tqdm=False)[0]
    assert output.prompt_token_ids == source.encode(text)
    assert len(output.outputs[0].token_ids) == 4 and output.outputs[0].text
    chat = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)[0]
    expected = source.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert chat.prompt_token_ids == expected


def test_transformers_reads_the_llama_file_as_its_twin(gguf_models) -> None:
    """transformers' own GGUF reader (its reading of llama.cpp's Llama Q/K row order) decodes the
    Llama file to the twin's tensors: the test files reorder those rows as llama.cpp does."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path, twin = gguf_models["llama"]
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(twin))
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    expected = load_file(str(Path(twin) / "model.safetensors"))
    assert set(expected) <= set(tensors)
    for name, values in expected.items():
        assert torch.equal(torch.as_tensor(tensors[name]).float(), values), name


def test_two_tensor_parallel_ranks_load_a_gguf_file(gguf_models) -> None:
    """Each rank narrows the dequantized tensors to its share, as it does a folder's."""
    path, _ = gguf_models["qwen3"]
    prompts = [{"prompt_token_ids": p} for p in random_prompts([9, 21], seed=8)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in _llm(path).generate(prompts, params, use_tqdm=False)]
    two = LLM(path, dtype="float32", device="cpu", block_size=4, max_model_len=128,
              tensor_parallel_size=2)  # fmt: skip
    assert [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)] == one
