"""LoRA on a GPU (skipped without CUDA): Triton shrink/expand compiled, CUDA graphs captured
with the LoRA layers inside, decode batches replaying them with any mix of adapters; greedy
tokens equal transformers + PEFT's (fp32)."""

from __future__ import annotations

import pytest
import torch

from ferrum import LoRARequest, SamplingParams
from tests.utils.lora_adapters import peft_greedy
from tests.utils.tiny_llm import MAX_TOKENS, cuda_llm, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_graphs_with_adapters_match_peft(tiny_checkpoint, peft_adapter, arch) -> None:
    base = tiny_checkpoint(arch)
    a = LoRARequest("a", 1, peft_adapter(arch, rank=4, seed=1))
    b = LoRARequest("b", 2, peft_adapter(arch, rank=8, seed=2, targets=("q_proj", "up_proj")))
    prompts = random_prompts([5, 40, 2, 19, 33, 7], seed=21)
    loras = [a, None, b, a, b, None]
    llm = cuda_llm(base, enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64)
    runner = llm.llm_engine.core.executor.runner
    assert runner.cuda_graphs is not None and runner.lora.batch.segments is not None
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(2):  # the second round: adapters already in their slots, prefix hits
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
        )
        expected = [
            peft_greedy(base, None if lora is None else lora.lora_path, [p], MAX_TOKENS)[0]
            for p, lora in zip(prompts, loras)
        ]
        assert [o.outputs[0].token_ids for o in outputs] == expected


def test_base_model_steps_replay_the_graphs_without_adapters(tiny_checkpoint, peft_adapter):
    """A LoRA engine's decode graphs come twice, with and without the adapters' kernels; steps
    without an adapter (before any adapter request, and after) give the base model's tokens, and
    a step mixing both gives each its own."""
    base = tiny_checkpoint("qwen3")
    a = LoRARequest("a", 1, peft_adapter("qwen3", rank=4, seed=1))
    prompts = random_prompts([5, 9, 3], seed=4)
    llm = cuda_llm(base, enable_lora=True, max_loras=1, max_lora_rank=8, num_kv_blocks=64)
    graphs = llm.llm_engine.core.executor.runner.cuda_graphs
    assert graphs is not None
    assert set(graphs.base_graphs) == {(s, s) for s in graphs.decode_sizes}

    class Counted:  # a base graph that counts its replays
        def __init__(self, graph) -> None:  # noqa: ANN001
            self.graph, self.replays = graph, 0

        def replay(self) -> None:
            self.replays += 1
            self.graph.replay()

    counted = {shape: Counted(graph) for shape, graph in graphs.base_graphs.items()}
    graphs.base_graphs.update(counted)  # type: ignore[arg-type]

    def base_replays() -> int:
        return sum(graph.replays for graph in counted.values())

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def greedy(loras):  # noqa: ANN001, ANN202
        inputs = [{"prompt_token_ids": p} for p in prompts]
        outputs = llm.generate(inputs, params, use_tqdm=False, lora_request=loras)
        return [o.outputs[0].token_ids for o in outputs]

    plain = [peft_greedy(base, None, [p], MAX_TOKENS)[0] for p in prompts]
    assert greedy(None) == plain
    before = base_replays()
    assert before > 0
    mixed = greedy([a, None, a])
    assert mixed[1] == plain[1]
    assert [mixed[0], mixed[2]] == peft_greedy(base, a.lora_path, prompts[::2], MAX_TOKENS)
    assert [mixed[0], mixed[2]] != [plain[0], plain[2]]  # the adapter changes the tokens
    assert greedy(None) == plain
    assert base_replays() > before


def test_one_row_takes_the_gemv_with_its_adapter_in_one_launch(monkeypatch) -> None:
    from ferrum.kernels import gemv_lora
    from ferrum.kernels.interface import triton_kernels
    from ferrum.lora.layers import LoRABatch, LoRALinear
    from ferrum.model_executor.layers.linear import MergedLinear
    from ferrum.model_executor.layers.quantization.dense import DenseLinearMethod

    device, dtype, gen = torch.device("cuda"), torch.bfloat16, torch.Generator().manual_seed(3)
    method = DenseLinearMethod(triton_kernels())
    base = MergedLinear(256, {"q": 256, "k": 64, "v": 64}, quant_method=method)
    base.weight.data = (torch.randn(384, 256, generator=gen) * 0.05).to(device, dtype)
    batch = LoRABatch(8, 2, device, is_triton=True, fuses_gemv=True)
    layer = LoRALinear(base, batch, max_loras=2, max_rank=8, dtype=dtype)
    a_q, a_v = torch.randn(2, 4, 256, generator=gen).to(device, dtype) * 0.1
    b_q = torch.randn(256, 4, generator=gen).to(device, dtype)
    b_v = torch.randn(64, 4, generator=gen).to(device, dtype)
    layer.set_slot(1, {"q": (a_q, b_q), "v": (a_v, b_v)})
    batch.token_slots[:2] = torch.tensor([1, -1], dtype=torch.int32)
    batch.regroup()
    launches = []
    fused = gemv_lora.gemv_lora
    counted = lambda *args, **kw: launches.append(1) or fused(*args, **kw)  # noqa: E731
    monkeypatch.setattr(gemv_lora, "gemv_lora", counted)
    x = torch.randn(2, 256, generator=gen).to(device, dtype)
    batch.raise_forward_number()  # what the model's pre-hook does as each forward begins
    one_row = layer(x[:1])
    assert launches == [1] and batch.forward_seq.item() == 1
    batch.raise_forward_number()
    two_rows = layer(x)  # shrink + expand
    assert launches == [1]
    torch.testing.assert_close(one_row[0].float(), two_rows[0].float(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(two_rows[1], base(x[1:])[0])
    delta = (one_row[0] - base(x[:1])[0]).float()
    assert delta[256:320].abs().max() == 0 and delta[:256].abs().max() > 0.1  # k has no adapter


def test_one_row_decode_in_bf16_follows_peft(tiny_checkpoint, peft_adapter) -> None:
    """One request at a time in bf16 (CUDA graphs): every decode step runs the fused one-row
    GEMV. Its greedy tokens are PEFT's (fp32) most likely next token after the same prefix
    (teacher forcing) at nearly every step; an adapter product read from an older forward's t
    would not be."""
    from peft import PeftModel

    from tests.utils.tiny_checkpoints import hf_logits, load_hf_model

    base = tiny_checkpoint("qwen3")
    path = peft_adapter("qwen3", rank=8, seed=5)
    llm = cuda_llm(base, dtype="bfloat16", enable_lora=True, max_loras=1, max_lora_rank=8,
                   num_kv_blocks=64)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    reference = PeftModel.from_pretrained(load_hf_model(base), path).eval()
    agree = total = 0
    for prompt in random_prompts([7, 23, 12], seed=4):
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False,
                              lora_request=LoRARequest("a", 1, path))  # fmt: skip
        tokens = list(out.outputs[0].token_ids)
        for i, token in enumerate(tokens):
            agree += int(hf_logits(reference, prompt + tokens[:i])[-1].argmax()) == token
            total += 1
    runner = llm.llm_engine.core.executor.runner
    assert any(layer.t_scratch is not None for layer in runner.lora.layers.values())
    assert agree >= 0.9 * total, (agree, total)
