"""Architecture name (config.json `architectures[0]`) -> model class, imported on demand."""

from __future__ import annotations

import importlib

from ferrum.model_arch import SUPPORTED_ARCHITECTURES

# architecture -> (module under ferrum.model_executor.models, class name); the keys are
# SUPPORTED_ARCHITECTURES, which configs are checked against before anything loads.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma3", "Gemma3ForConditionalGeneration"),
    "Qwen3_5ForCausalLM": ("qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForCausalLM": ("qwen3_5", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5", "Qwen3_5MoeForConditionalGeneration"),
}


def supported_architectures() -> list[str]:
    return list(SUPPORTED_ARCHITECTURES)


def get_model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise ValueError(
            f"architecture {architecture!r} is not supported; "
            f"supported: {supported_architectures()}"
        )
    module_name, class_name = _MODELS[architecture]
    module = importlib.import_module(f"ferrum.model_executor.models.{module_name}")
    return getattr(module, class_name)
