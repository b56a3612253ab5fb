"""The EAGLE-3 head of `speculative_config` (method eagle3): its config.json, read once into
typed fields and checked against the target. The head is one Llama decoder layer whose
attention reads [norm(token embedding), norm(fused hidden state)] (2 * hidden_size wide); `fc`
fuses the target's residual stream at the inputs of `aux_layer_ids` (vLLM's numbering: id i is
the input of layer i, 0 the embedding); `lm_head` scores a draft vocabulary whose ids map to the
target's through `d2t` (target id = draft id + d2t[draft id])."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ferrum.config_fields import field_error
from ferrum.errors import FieldError
from ferrum.kv.kv_cache_spec import kv_cache_groups
from ferrum.model_arch import ModelArchConfig
from ferrum.model_folder import read_hf_config

# config.json `architectures[0]` of the public EAGLE-3 checkpoints (EAGLE, SpecForge, AngelSlim).
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# Targets whose decoder stack hands the head its hidden states (models/llama.py's LlamaModel).
EAGLE3_TARGETS = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)
_FIELD = "speculative_config.model"


@dataclass(frozen=True)
class Eagle3Config:
    model: str  # the head's folder
    # The decoder layer's shapes (hidden_size, heads, intermediate_size, RoPE, eps).
    arch: ModelArchConfig
    draft_vocab_size: int
    target_hidden_size: int
    # Target layers whose input (residual stream) the head fuses, in fc's input order.
    aux_layer_ids: tuple[int, ...]
    # The fused hidden state enters the residual stream normed (True) or as is (False).
    norm_before_residual: bool


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's choice when the head names none: low, middle and high layers."""
    return (2, num_layers // 2, num_layers - 3)


def read_eagle3_config(path: str, target: ModelArchConfig) -> Eagle3Config:
    """The head in folder `path`, refused by name (`speculative_config.model`) when it is not
    an EAGLE-3 head of one layer, when its vocabulary or target hidden size differ from the
    target's, or when it names target layers the target does not have."""
    try:
        hf = read_hf_config(path)
    except FieldError as e:
        raise field_error(_FIELD, f"{path!r} cannot be an EAGLE-3 head: {e}") from e
    names = hf.get("architectures") or [None]
    if names[0] not in EAGLE3_ARCHITECTURES:
        raise field_error(
            _FIELD, f"{path!r} is a {names[0]!r}, not an EAGLE-3 head ({EAGLE3_ARCHITECTURES})"
        )
    _check_target(target)
    eagle = hf.get("eagle_config") if isinstance(hf.get("eagle_config"), dict) else {}
    if eagle.get("use_aux_hidden_state") is False:
        raise field_error(_FIELD, "a head without aux hidden states (EAGLE-1/2) is not EAGLE-3")
    try:
        arch = ModelArchConfig.from_hf_config({**hf, "architectures": ["LlamaForCausalLM"]})
    except ValueError as e:
        raise field_error(_FIELD, f"{path!r}: {e}") from e
    _check_shapes(hf, arch, target)
    # The head runs at the target's positions (RoPE table), whatever context it was trained on.
    positions = max(arch.max_position_embeddings, target.max_position_embeddings)
    arch = replace(arch, max_position_embeddings=positions)
    ids = hf.get("eagle_aux_hidden_state_layer_ids") or eagle.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    num_layers = target.num_hidden_layers
    aux = tuple(ids) if ids else default_aux_layer_ids(num_layers)
    if not all(isinstance(i, int) and 0 <= i < num_layers for i in aux):
        raise field_error(
            _FIELD,
            f"eagle_aux_hidden_state_layer_ids {list(aux)} must be layers of the "
            f"{num_layers}-layer target (0..{num_layers - 1})",
        )
    return Eagle3Config(
        model=path,
        arch=arch,
        draft_vocab_size=int(hf.get("draft_vocab_size") or arch.vocab_size),
        target_hidden_size=int(hf.get("target_hidden_size") or arch.hidden_size),
        aux_layer_ids=aux,
        norm_before_residual=bool(hf.get("norm_before_residual", False)),
    )


def _check_shapes(hf: dict[str, Any], arch: ModelArchConfig, target: ModelArchConfig) -> None:
    if arch.num_hidden_layers != 1:
        raise field_error(
            _FIELD, f"num_hidden_layers: an EAGLE-3 head has 1, got {arch.num_hidden_layers}"
        )
    if arch.vocab_size != target.vocab_size:
        raise field_error(
            _FIELD,
            f"vocab_size {arch.vocab_size} differs from the target's {target.vocab_size}: the "
            "head must share the target's tokenizer",
        )
    draft_vocab = int(hf.get("draft_vocab_size") or arch.vocab_size)
    if not 1 <= draft_vocab <= arch.vocab_size:
        raise field_error(
            _FIELD, f"draft_vocab_size: must be in [1, {arch.vocab_size}], got {draft_vocab}"
        )
    target_hidden = int(hf.get("target_hidden_size") or arch.hidden_size)
    if target_hidden != target.hidden_size:
        raise field_error(
            _FIELD,
            f"target_hidden_size {target_hidden} differs from the target's hidden_size "
            f"{target.hidden_size}",
        )


def _check_target(target: ModelArchConfig) -> None:
    """The head reads the hidden states of a Llama-style stack and the block tables of its
    full-attention layers (its own cache has one block per block of theirs)."""
    if target.architecture not in EAGLE3_TARGETS:
        raise field_error(
            "speculative_config.method",
            f"eagle3 needs a target in {EAGLE3_TARGETS}, got {target.architecture}",
        )
    windows = [target.layer_sliding_window(i) for i in range(target.num_hidden_layers)]
    first = kv_cache_groups(windows, target.linear_attention_layers)[0]
    if first.sliding_window is not None or first.recurrent:
        raise field_error(
            "speculative_config.method",
            f"eagle3 needs full-attention layers in the target {target.architecture}",
        )
