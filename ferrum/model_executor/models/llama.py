"""Llama 2/3 (GQA, optional llama3 RoPE scaling, optional attention/MLP biases).

The decoder stack, the causal-LM wrapper and checkpoint-name mapping here are shared with the
Qwen models, which subclass `LlamaForCausalLM` and override `make_decoder_layer`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ferrum.config import ModelConfig
from ferrum.model_executor.layers.activation import get_act_and_mul
from ferrum.model_executor.layers.attention import Attention
from ferrum.model_executor.layers.embed_head import LMHead, VocabEmbedding
from ferrum.model_executor.layers.layernorm import RMSNorm
from ferrum.model_executor.layers.linear import Linear, MergedLinear
from ferrum.model_executor.layers.rotary import get_rope
from ferrum.model_executor.weight_loader import load_named_weights

if TYPE_CHECKING:
    from ferrum.model_executor.attention_metadata import AttentionMetadata

# (checkpoint fragment, parameter fragment, shard id) for projections fused at load time.
STACKED_PARAMS = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", "gate"),
    (".up_proj.", ".gate_up_proj.", "up"),
)


def required(hf_config: dict[str, Any], key: str) -> Any:
    """A config.json value the model cannot be built without."""
    value = hf_config.get(key)
    if value is None:
        raise ValueError(f"{key}: missing from config.json")
    return value


def check_supported(hf_config: dict[str, Any]) -> None:
    """Rejects config features the shared decoder does not compute."""
    if hf_config.get("use_sliding_window"):
        raise ValueError("use_sliding_window: sliding-window attention is not supported")


class LlamaMLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(
            hidden_size, {"gate": intermediate_size, "up": intermediate_size}, bias
        )
        self.down_proj = Linear(intermediate_size, hidden_size, bias)
        self.act_fn = get_act_and_mul(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, model_config: ModelConfig, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        hidden_size = int(required(model_config.hf_config, "hidden_size"))
        self.num_heads = model_config.num_attention_heads
        self.num_kv_heads = model_config.num_kv_heads
        self.head_dim = model_config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(
            hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}, qkv_bias
        )
        self.o_proj = Linear(self.q_size, hidden_size, o_bias)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5)
        # Per-head RMSNorm of q and k before RoPE (Qwen3 sets them).
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None

    def project_qkv(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, hidden] -> q [T, num_heads, D], k and v [T, num_kv_heads, D] (before RoPE)."""
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        num_tokens = hidden.shape[0]
        return (
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.project_qkv(hidden)
        out = self.attn.forward_with_rope(
            q, k, v, cos, sin, attn_metadata, q_norm=self.q_norm, k_norm=self.k_norm
        )
        return self.o_proj(out.reshape(out.shape[0], self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual stream before it); the next norm adds the two."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, model_config: ModelConfig, make_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        hf = model_config.hf_config
        hidden_size = int(required(hf, "hidden_size"))
        self.embed_tokens = VocabEmbedding(model_config.vocab_size, hidden_size)
        self.rotary_emb = get_rope(model_config.head_dim, hf)
        self.layers = nn.ModuleList(make_layer(i) for i in range(model_config.num_hidden_layers))
        self.norm = RMSNorm(hidden_size, float(hf.get("rms_norm_eps", 1e-6)))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin, attn_metadata)
        if residual is None:
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        self.model_config = model_config
        hf = model_config.hf_config
        check_supported(hf)
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
        self.model = LlamaModel(model_config, self.make_decoder_layer)
        self.lm_head = LMHead(
            model_config.vocab_size,
            int(required(hf, "hidden_size")),
            tied_to=self.model.embed_tokens if self.tie_word_embeddings else None,
        )

    def make_decoder_layer(self, layer_idx: int) -> nn.Module:
        hf = self.model_config.hf_config
        bias = bool(hf.get("attention_bias", False))
        hidden_size = int(required(hf, "hidden_size"))
        return LlamaDecoderLayer(
            LlamaAttention(self.model_config, qkv_bias=bias, o_bias=bias),
            LlamaMLP(
                hidden_size,
                int(required(hf, "intermediate_size")),
                hf.get("hidden_act", "silu"),
                bool(hf.get("mlp_bias", False)),
            ),
            hidden_size,
            float(hf.get("rms_norm_eps", 1e-6)),
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] int64 -> hidden states [num_tokens, hidden_size]."""
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] float32."""
        return self.lm_head(hidden_states)

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """One cache per decoder layer, in layer order; an empty list unbinds them all."""
        layers = self.model.layers
        if kv_caches and len(kv_caches) != len(layers):
            raise ValueError(
                f"kv_caches: expected one cache per decoder layer ({len(layers)}), "
                f"got {len(kv_caches)}"
            )
        for i, layer in enumerate(layers):
            attn = layer.self_attn.attn
            if kv_caches:
                attn.bind_kv_cache(kv_caches[i])
            else:
                attn.kv_cache = None

    def map_checkpoint_name(self, name: str) -> tuple[str, Hashable] | None:
        """HF checkpoint tensor name -> (parameter name, shard id), or None to skip it."""
        if "rotary_emb.inv_freq" in name:
            return None
        if self.tie_word_embeddings and name == "lm_head.weight":
            return None
        for ckpt_part, param_part, shard_id in STACKED_PARAMS:
            if ckpt_part in name:
                return name.replace(ckpt_part, param_part), shard_id
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads HF-named tensors; returns the names of the parameters fully loaded."""
        return load_named_weights(dict(self.named_parameters()), weights, self.map_checkpoint_name)
