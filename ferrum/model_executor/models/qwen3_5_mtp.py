"""Qwen3.5's multi-token-prediction head (checkpoint tensors `mtp.*`): row i pairs the target's
final (normed) hidden state h_i at position i with the token t after it and predicts the token
after t:
    x = fc([norm_e(embed(t)), norm_h(h_i)])         (fc: 2 * hidden -> hidden, no bias)
    out = norm(layer(x))                            (one gated full-attention decoder layer)
    draft = argmax(lm_head(out))
The norms are (1 + w) RMSNorms; embedding and LM head are the target's. The next draft step pairs
`out` with the previous draft. Its attention layer has a paged KV cache of its own."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from ferrum.kernels.interface import Kernels
from ferrum.model_arch import FULL_ATTENTION, ModelArchConfig
from ferrum.model_executor.layers.attention import bind_single_cache
from ferrum.model_executor.layers.layernorm import GemmaRMSNorm
from ferrum.model_executor.layers.linear import Linear
from ferrum.model_executor.layers.rotary import RotaryEmbedding
from ferrum.model_executor.models.llama import LlamaMLP
from ferrum.model_executor.models.qwen3_5 import (
    Qwen3_5DecoderLayer,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeSparseMoeBlock,
)
from ferrum.model_executor.weight_loader import load_named_weights

if TYPE_CHECKING:
    from ferrum.kernels.paged_attention import SplitKVWorkspace
    from ferrum.model_executor.attention_metadata import AttentionMetadata

MTP_PREFIX = "mtp."
# The head's layer loads as the target's layer 0 would (stacked q/k/v, experts), then moves.
_TARGET_LAYER, _HEAD_LAYER = "model.layers.0.", "layers.0."


class Qwen3_5MTPHead(nn.Module):
    def __init__(self, arch: ModelArchConfig, kernels: Kernels, target: Qwen3_5ForCausalLM) -> None:
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.pre_fc_norm_embedding = GemmaRMSNorm(h, eps, kernels)
        self.pre_fc_norm_hidden = GemmaRMSNorm(h, eps, kernels)
        self.fc = Linear(2 * h, h, bias=False)
        layer_arch = replace(arch, layer_types=(FULL_ATTENTION,))
        prefix = "mtp.layers.0.mlp"
        mlp = (
            Qwen3_5MoeSparseMoeBlock(layer_arch, kernels, prefix)
            if arch.num_experts
            else LlamaMLP(layer_arch, kernels, False, prefix=prefix)
        )
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(layer_arch, kernels, 0, mlp)])
        self.norm = GemmaRMSNorm(h, eps, kernels)
        self.rotary_emb = RotaryEmbedding(
            int(arch.head_dim * arch.partial_rotary_factor),
            arch.max_position_embeddings,
            arch.rope_theta,
            arch.rope_scaling,
        )
        # Not a submodule: the target owns (and loads) its embedding and LM head.
        self._target = (target,)

    def fuse(self, hidden: torch.Tensor) -> torch.Tensor:
        """The step pass's hidden input as it is (fc mixes it with the embedding)."""
        return hidden

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        hidden: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Row i: the token after position i and the hidden state at position i -> (normed
        output for the LM head, the same: the next step's `hidden`)."""
        target = self._target[0]
        embeds = self.pre_fc_norm_embedding(target.model.embed_tokens(input_ids))
        x = self.fc(torch.cat([embeds, self.pre_fc_norm_hidden(hidden)], dim=-1))
        cos, sin = self.rotary_emb(positions)
        x, residual = self.layers[0](x, None, cos, sin, attn_metadata)
        out, _ = self.norm(x, residual)
        return out, out

    def draft_token_ids(self, normed: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n] int64: the greedy draft."""
        return self._target[0].compute_logits(normed).argmax(dim=-1)

    def bind_kv_caches(
        self,
        kv_caches: list[torch.Tensor],
        split_kv_workspace: SplitKVWorkspace | None = None,
        kv_cache_groups: Sequence[int] | None = None,
    ) -> None:
        """The layer's KV cache (an empty list unbinds it)."""
        bind_single_cache(
            self.layers[0].self_attn.attn, kv_caches, split_kv_workspace, kv_cache_groups
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads the checkpoint's `mtp.*` tensors (others are skipped); returns the names of
        the parameters fully loaded."""
        return load_named_weights(dict(self.named_parameters()), weights, self._map_name)

    def _map_name(self, name: str) -> tuple[str, Hashable] | None:
        if not name.startswith(MTP_PREFIX):
            return None
        name = name.removeprefix(MTP_PREFIX)
        if not name.startswith(_HEAD_LAYER):
            return name, None
        mapped = self._target[0].map_checkpoint_name(_TARGET_LAYER + name[len(_HEAD_LAYER) :])
        if mapped is None:
            return None
        return _HEAD_LAYER + mapped[0].removeprefix(_TARGET_LAYER), mapped[1]
