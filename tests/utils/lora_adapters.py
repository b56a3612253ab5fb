"""PEFT LoRA adapters written by `peft` for the tiny checkpoints, and their greedy oracle.

    make_peft_adapter(base, out, rank=, alpha=, targets=, use_rslora=, seed=) -> str (folder)
    peft_greedy(base, adapter, prompts, max_new_tokens, merged=False) -> generated ids per prompt

Both lora_A and lora_B are random (PEFT initialises B to zero, which would make the adapter a
no-op), std 0.3, so an adapter changes the greedy tokens of the tiny models.
"""

from __future__ import annotations

import os

import torch

from tests.utils.tiny_checkpoints import hf_logits, load_hf_model

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(
    base: str,
    out: str | os.PathLike[str],
    *,
    rank: int = 4,
    alpha: float = 8.0,
    targets: tuple[str, ...] | str = ALL_TARGETS,
    use_rslora: bool = False,
    seed: int = 0,
    **lora_config: object,
) -> str:
    """Writes adapter_config.json + adapter_model.safetensors of a random adapter of `base`."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets if isinstance(targets, str) else list(targets),
        use_rslora=use_rslora,
        lora_dropout=0.0,
        **lora_config,
    )
    model = get_peft_model(load_hf_model(base), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(str(out))
    return str(out)


@torch.no_grad()
def peft_greedy(
    base: str,
    adapter: str | None,
    prompts: list[list[int]],
    max_new_tokens: int,
    merged: bool = False,
) -> list[list[int]]:
    """Greedy tokens of transformers + PEFT with `adapter` (None: the base model), one prompt at
    a time; `merged`: after merge_and_unload (the adapter folded into the weights)."""
    from peft import PeftModel

    model = load_hf_model(base)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
        if merged:
            model = model.merge_and_unload()
    outputs = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(max_new_tokens):
            ids.append(int(hf_logits(model, ids)[-1].argmax()))
        outputs.append(ids[len(prompt) :])
    return outputs
