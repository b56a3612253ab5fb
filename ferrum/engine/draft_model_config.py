"""The draft model of `speculative_config` (method draft_model): its ModelConfig, in the
target's dtype, context length and load format, checked against the target; the EAGLE-3 head
(method eagle3): its config (`eagle3_config.py`)."""

from __future__ import annotations

from ferrum.config import ModelConfig
from ferrum.config_fields import field_error
from ferrum.eagle3_config import Eagle3Config, read_eagle3_config
from ferrum.kv.kv_cache_spec import kv_cache_groups
from ferrum.model_arch import ModelArchConfig
from ferrum.speculative_config import SpeculativeConfig


def draft_model_config(spec: SpeculativeConfig | None, target: ModelConfig) -> ModelConfig | None:
    """None unless `spec` asks for a draft model. Refused by name: a draft that cannot load or
    run target's context, another vocabulary size, linear-attention layers in the draft, a
    target without full-attention layers (the draft reads their block tables)."""
    if spec is None or spec.method != "draft_model":
        return None
    assert spec.model is not None
    name = "speculative_config.model"
    try:
        draft = ModelConfig(
            model=spec.model,
            dtype=target.dtype,
            load_format=target.load_format,
            skip_tokenizer_init=True,
            max_model_len=target.max_model_len,
            seed=target.seed,
        )
    except (ValueError, OSError) as e:
        raise field_error(name, f"{spec.model!r} cannot be the draft model: {e}") from e
    if draft.vocab_size != target.vocab_size:
        raise field_error(
            name,
            f"the draft's vocab_size {draft.vocab_size} differs from the target's "
            f"{target.vocab_size}: the draft must share the target's tokenizer",
        )
    if draft.arch.linear_attention_layers:
        raise field_error(name, f"a {draft.architecture} draft (linear attention) is not supported")
    arch = target.arch
    windows = [arch.layer_sliding_window(i) for i in range(arch.num_hidden_layers)]
    first = kv_cache_groups(windows, arch.linear_attention_layers)[0]
    if first.sliding_window is not None or first.recurrent:
        raise field_error(
            name, f"a draft model needs full-attention layers in the target {target.architecture}"
        )
    return draft


def eagle3_config(spec: SpeculativeConfig | None, target: ModelArchConfig) -> Eagle3Config | None:
    """None unless `spec` asks for an EAGLE-3 head; else the head's config, checked."""
    if spec is None or spec.method != "eagle3":
        return None
    assert spec.model is not None
    return read_eagle3_config(spec.model, target)
