"""An EAGLE-3 head (`eagle3_config.py`): one Llama decoder layer over [norm(embedding of the next
token), norm(hidden)], where hidden is `fc` of the target's fused hidden states (the first draft
step) or the head's own pre-norm output (the steps after it). Checkpoint names as the public
heads write them: `midlayer.*`, `fc.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d` and
an optional `embed_tokens.weight` (else the target's embedding is used). Replicated on every
tensor-parallel rank; with the target's (vocab-split) embedding each rank all-reduces it."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from ferrum.eagle3_config import Eagle3Config
from ferrum.kernels.interface import Kernels
from ferrum.model_executor.layers.attention import bind_single_cache
from ferrum.model_executor.layers.embed_head import LMHead, VocabEmbedding
from ferrum.model_executor.layers.layernorm import RMSNorm
from ferrum.model_executor.layers.linear import Linear
from ferrum.model_executor.layers.parallel_linear import QKVParallelLinear
from ferrum.model_executor.layers.rotary import RotaryEmbedding
from ferrum.model_executor.models.llama import STACKED_PARAMS, LlamaAttention, LlamaMLP
from ferrum.model_executor.weight_loader import load_named_weights

if TYPE_CHECKING:
    from ferrum.kernels.paged_attention import SplitKVWorkspace
    from ferrum.model_executor.attention_metadata import AttentionMetadata


class Eagle3DecoderLayer(nn.Module):
    """A Llama layer whose attention projects 2 * hidden_size inputs; `hidden_norm` norms the
    fused hidden state, `input_layernorm` the token embedding."""

    def __init__(self, config: Eagle3Config, kernels: Kernels) -> None:
        super().__init__()
        arch = config.arch
        self.self_attn = LlamaAttention(arch, kernels, arch.attention_bias, arch.attention_bias)
        self.self_attn.qkv_proj = QKVParallelLinear(
            2 * arch.hidden_size,
            arch.head_dim,
            arch.num_attention_heads,
            arch.num_kv_heads,
            arch.attention_bias,
        )
        self.mlp = LlamaMLP(arch, kernels, arch.mlp_bias)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, kernels)
        self.hidden_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, kernels)
        self.norm_before_residual = config.norm_before_residual

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual stream before it); `hidden` is left as it was."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden.clone()
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        x = self.self_attn(x, cos, sin, attn_metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3Head(nn.Module):
    def __init__(
        self, config: Eagle3Config, kernels: Kernels, target_embedding: VocabEmbedding | None
    ) -> None:
        """`target_embedding`: the target's, for a head without `embed_tokens` (None: its own)."""
        super().__init__()
        arch = config.arch
        # Its own embedding, or None: the target's, kept out of the head's parameters (loading
        # or randomizing the head never touches the target's weights).
        self.embed_tokens = (
            VocabEmbedding(arch.vocab_size, arch.hidden_size) if target_embedding is None else None
        )
        self._embed = target_embedding.forward if target_embedding is not None else None
        self.fc = Linear(len(config.aux_layer_ids) * config.target_hidden_size, arch.hidden_size)
        self.midlayer = Eagle3DecoderLayer(config, kernels)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, kernels)
        self.lm_head = LMHead(config.draft_vocab_size, arch.hidden_size, kernels)
        self.rotary_emb = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
        )
        # Draft id -> target id offset (identity until the checkpoint's d2t loads).
        self.register_buffer(
            "d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64), persistent=False
        )

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[n, len(aux_layer_ids) * target_hidden] -> [n, hidden_size]."""
        return self.fc(aux_hidden)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        hidden: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Row i: the token after position i and the hidden state at position i -> (normed
        output for the LM head, pre-norm output: the next step's `hidden`)."""
        cos, sin = self.rotary_emb(positions)
        embed = self.embed_tokens if self.embed_tokens is not None else self._embed
        assert embed is not None
        x, residual = self.midlayer(embed(input_ids), hidden, cos, sin, attn_metadata)
        normed, prenorm = self.norm(x, residual)
        return normed, prenorm

    def draft_token_ids(self, normed: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n] int64: the greedy draft, as a target token id."""
        draft = self.lm_head(normed).argmax(dim=-1)
        return draft + self.d2t[draft]

    def bind_kv_caches(
        self,
        kv_caches: list[torch.Tensor],
        split_kv_workspace: SplitKVWorkspace | None = None,
        kv_cache_groups: Sequence[int] | None = None,
    ) -> None:
        """`LlamaForCausalLM.bind_kv_caches` for the one layer (an empty list unbinds it)."""
        bind_single_cache(
            self.midlayer.self_attn.attn, kv_caches, split_kv_workspace, kv_cache_groups
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads the head's tensors (`d2t` into its buffer, `t2d` unused); returns the names of
        the parameters fully loaded."""
        params = dict(self.named_parameters())
        return load_named_weights(params, self._own_tensors(weights), self._map_name)

    def _own_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name == "d2t":
                self.d2t.copy_(tensor)
            elif name != "t2d":
                yield name, tensor

    def _map_name(self, name: str) -> tuple[str, Hashable] | None:
        for ckpt_part, param_part, shard_id in STACKED_PARAMS:
            if ckpt_part in name:
                return name.replace(ckpt_part, param_part), shard_id
        return name, None
