"""Llama 2/3 (GQA, optional llama3 RoPE scaling, optional attention/MLP biases). The decoder
stack, the causal-LM wrapper and checkpoint-name mapping here are shared with the Qwen models,
which subclass `LlamaForCausalLM` and override `make_decoder_layer`."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from ferrum.distributed.parallel_state import TensorParallelGroup
from ferrum.kernels.interface import Kernels
from ferrum.model_arch import ModelArchConfig
from ferrum.model_executor.layers.activation import get_act_and_mul
from ferrum.model_executor.layers.attention import Attention
from ferrum.model_executor.layers.embed_head import LMHead, VocabEmbedding
from ferrum.model_executor.layers.layernorm import RMSNorm
from ferrum.model_executor.layers.parallel_linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from ferrum.model_executor.layers.quantization import get_linear_method
from ferrum.model_executor.layers.rotary import RotaryEmbedding
from ferrum.model_executor.pipeline_stage import (
    PipelineStage,
    StageActivations,
    stage_input,
    stage_layers,
    stage_output,
    whole_model,
)
from ferrum.model_executor.weight_loader import load_named_weights
from ferrum.quant_config import QuantConfig

if TYPE_CHECKING:
    from ferrum.kernels.fp8_quant import Fp8GroupRows
    from ferrum.kernels.paged_attention import SplitKVWorkspace
    from ferrum.model_executor.attention_metadata import AttentionMetadata
    from ferrum.model_executor.layers.aux_hidden_states import AuxHiddenStates

# (checkpoint fragment, parameter fragment, shard id) for projections fused at load time.
STACKED_PARAMS = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", "gate"),
    (".up_proj.", ".gate_up_proj.", "up"),
)


def layer_prefix(layer_idx: int) -> str:
    """The checkpoint name prefix of decoder layer `layer_idx`."""
    return f"model.layers.{layer_idx}"


class LlamaMLP(nn.Module):
    """gate/up column-parallel, down row-parallel: one all-reduce per MLP."""

    def __init__(
        self,
        arch: ModelArchConfig,
        kernels: Kernels,
        bias: bool,
        tp_group: TensorParallelGroup | None = None,
        quant_config: QuantConfig | None = None,
        prefix: str = "mlp",
    ) -> None:
        """`prefix`: this MLP's checkpoint module name (it picks the quantized layers)."""
        super().__init__()
        size = arch.intermediate_size
        gate_up = get_linear_method(
            quant_config, kernels, [f"{prefix}.gate_proj", f"{prefix}.up_proj"]
        )
        down = get_linear_method(quant_config, kernels, [f"{prefix}.down_proj"])
        self.gate_up_proj = MergedColumnParallelLinear(
            arch.hidden_size, {"gate": size, "up": size}, bias, tp_group, quant_method=gate_up
        )
        self.down_proj = RowParallelLinear(
            size, arch.hidden_size, bias, tp_group, quant_method=down
        )
        self.act_fn = get_act_and_mul(arch.hidden_act, kernels)

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        return self.gate_up_proj.takes_fp8_rows(x)

    def forward(self, x: torch.Tensor, x_fp8: Fp8GroupRows | None = None) -> torch.Tensor:
        """`x_fp8`: x's rows quantized per token-group of 128, where `takes_fp8_rows(x)`."""
        gate_up = self.gate_up_proj(x, x_fp8)
        if self.act_fn.writes_fp8_rows(gate_up):
            # Sized like the activation: the down projection's input.
            act_like = gate_up[..., : gate_up.shape[-1] // 2]
            if self.down_proj.takes_fp8_rows(act_like):
                act, rows = self.act_fn.forward_fp8(gate_up)
                return self.down_proj(act, rows)
        return self.down_proj(self.act_fn(gate_up))


class LlamaAttention(nn.Module):
    """This rank's heads (num_heads / tp, KV heads split or replicated): qkv column-parallel by
    heads, o row-parallel (one all-reduce per attention)."""

    def __init__(
        self,
        arch: ModelArchConfig,
        kernels: Kernels,
        qkv_bias: bool,
        o_bias: bool,
        sliding_window: int | None = None,
        scale: float | None = None,
        tp_group: TensorParallelGroup | None = None,
        quant_config: QuantConfig | None = None,
        prefix: str = "self_attn",
    ) -> None:
        """`prefix`: this module's checkpoint name (it picks the quantized layers)."""
        super().__init__()
        self.head_dim = arch.head_dim
        qkv = get_linear_method(
            quant_config, kernels, [f"{prefix}.{name}_proj" for name in ("q", "k", "v")]
        )
        o = get_linear_method(quant_config, kernels, [f"{prefix}.o_proj"])
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size,
            self.head_dim,
            arch.num_attention_heads,
            arch.num_kv_heads,
            qkv_bias,
            tp_group,
            quant_method=qkv,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            arch.num_attention_heads * self.head_dim,
            arch.hidden_size,
            o_bias,
            tp_group,
            quant_method=o,
        )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            self.head_dim**-0.5 if scale is None else scale,
            kernels,
            sliding_window,
        )
        # Per-head RMSNorm of q and k before RoPE (Qwen3 sets them).
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None

    def takes_fp8_rows(self, hidden: torch.Tensor) -> bool:
        return self.qkv_proj.takes_fp8_rows(hidden)

    def project_qkv(
        self, hidden: torch.Tensor, hidden_fp8: Fp8GroupRows | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, hidden] -> q [T, num_heads, D], k and v [T, num_kv_heads, D] (before RoPE)."""
        qkv = self.qkv_proj(hidden, hidden_fp8)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
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
        hidden_fp8: Fp8GroupRows | None = None,
    ) -> torch.Tensor:
        q, k, v = self.project_qkv(hidden, hidden_fp8)
        # q has the o_proj input's rows and dtype: the attention output replaces it. Whether
        # o_proj takes rows varies with the step's size only through its GEMV buckets (one row),
        # so each attention tile compiles one rows variant (besides the one-row decode tile's).
        out_fp8 = None
        if self.attn.writes_fp8_rows() and self.o_proj.takes_fp8_rows(q):
            from ferrum.kernels.fp8_quant import empty_group_rows

            out_fp8 = empty_group_rows(q.shape[0], self.q_size, q.device)
        out = self.attn(
            q, k, v, cos, sin, attn_metadata, q_norm=self.q_norm, k_norm=self.k_norm,
            out_fp8=out_fp8,
        )  # fmt: skip
        return self.o_proj(out.reshape(out.shape[0], self.q_size), out_fp8)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        self_attn: nn.Module,
        mlp: nn.Module,
        arch: ModelArchConfig,
        kernels: Kernels,
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, kernels)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual stream before it); the next norm adds the two. A norm
        whose consumer reads FP8 rows (`takes_fp8_rows`) writes them too."""
        hidden, residual, rows = _norm(self.input_layernorm, hidden, residual, self.self_attn)
        hidden = self.self_attn(hidden, cos, sin, attn_metadata, rows)
        hidden, residual, rows = _norm(self.post_attention_layernorm, hidden, residual, self.mlp)
        return (self.mlp(hidden) if rows is None else self.mlp(hidden, rows)), residual


def _norm(
    norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor | None, consumer: nn.Module
) -> tuple[torch.Tensor, torch.Tensor, Fp8GroupRows | None]:
    """(normed, residual stream, FP8 rows of normed if `consumer` reads them, else None); with
    no residual yet, hidden is the residual stream."""
    takes_rows = getattr(consumer, "takes_fp8_rows", None)
    if takes_rows is not None and takes_rows(hidden):
        normed, new_residual, rows = norm.forward_fp8(hidden, residual)
        return normed, hidden if new_residual is None else new_residual, rows
    if residual is None:
        return norm(hidden), hidden, None
    normed, residual = norm(hidden, residual)
    return normed, residual, None


class LlamaModel(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        kernels: Kernels,
        make_layer: Callable[[int], nn.Module],
        tp_group: TensorParallelGroup | None = None,
        stage: PipelineStage | None = None,
    ) -> None:
        super().__init__()
        stage = stage or whole_model(arch.num_hidden_layers)
        self.embed_tokens = (
            VocabEmbedding(arch.vocab_size, arch.hidden_size, tp_group) if stage.is_first else None
        )
        self.rotary_emb = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
        )
        self.layers = stage_layers(stage, arch.num_hidden_layers, make_layer)
        self.stage_layers = [self.layers[i] for i in stage.layer_ids]
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, kernels) if stage.is_last else None
        self.aux_hidden_states: AuxHiddenStates | None = None  # an EAGLE-3 head's (whole model)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        intermediate: StageActivations | None = None,
    ) -> torch.Tensor | StageActivations:
        hidden, residual = stage_input(self.embed_tokens, input_ids, intermediate)
        cos, sin = self.rotary_emb(positions)
        for i, layer in enumerate(self.stage_layers):
            if self.aux_hidden_states is not None:
                self.aux_hidden_states.capture(i, hidden, residual)
            hidden, residual = layer(hidden, residual, cos, sin, attn_metadata)
        return stage_output(self.norm, hidden, residual)


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        kernels: Kernels,
        *,
        tp_group: TensorParallelGroup | None = None,
        enable_expert_parallel: bool = False,
        quant_config: QuantConfig | None = None,
        pipeline_stage: PipelineStage | None = None,
    ) -> None:
        """With a tensor-parallel group of several ranks: this rank's shard (every rank's
        `compute_logits` returns the same full logits). `enable_expert_parallel` applies to the
        MoE models' experts. `quant_config` quantizes the decoder layers' linear layers (never
        the embedding or the LM head). `pipeline_stage`: the layers this rank holds (default:
        all); only the last stage has the LM head."""
        super().__init__()
        self.arch = arch
        self.kernels = kernels
        self.tp_group = tp_group or TensorParallelGroup()
        self.enable_expert_parallel = enable_expert_parallel
        self.quant_config = quant_config
        self.stage = pipeline_stage or whole_model(arch.num_hidden_layers)
        self.model = self.make_model()
        self.lm_head: LMHead | None = None
        if self.stage.is_last:
            tied = arch.tie_word_embeddings and self.stage.is_first
            tied_to = self.model.embed_tokens if tied else None
            self.lm_head = LMHead(
                arch.vocab_size, arch.hidden_size, kernels, tied_to, self.tp_group
            )

    def make_model(self) -> nn.Module:
        """The decoder stack; it must have `embed_tokens` and `layers` (each with
        `self_attn.attn`)."""
        return LlamaModel(
            self.arch, self.kernels, self.make_decoder_layer, self.tp_group, self.stage
        )

    def make_decoder_layer(self, layer_idx: int) -> nn.Module:
        arch, kernels, bias = self.arch, self.kernels, self.arch.attention_bias
        quant, prefix = self.quant_config, layer_prefix(layer_idx)
        return LlamaDecoderLayer(
            LlamaAttention(
                arch,
                kernels,
                qkv_bias=bias,
                o_bias=bias,
                tp_group=self.tp_group,
                quant_config=quant,
                prefix=f"{prefix}.self_attn",
            ),
            LlamaMLP(arch, kernels, arch.mlp_bias, self.tp_group, quant, f"{prefix}.mlp"),
            arch,
            kernels,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        intermediate: StageActivations | None = None,
    ) -> torch.Tensor | StageActivations:
        """input_ids, positions: [num_tokens] int64 -> hidden states [num_tokens, hidden_size];
        a pipeline stage after the first takes the previous one's activations instead of the
        ids, and every stage but the last returns its (hidden, residual)."""
        return self.model(input_ids, positions, attn_metadata, intermediate)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] float32 (the full vocabulary on every rank of
        the last pipeline stage)."""
        assert self.lm_head is not None, "only the last pipeline stage computes logits"
        return self.lm_head(hidden_states)

    def bind_kv_caches(
        self,
        kv_caches: list[torch.Tensor],
        split_kv_workspace: SplitKVWorkspace | None = None,
        kv_cache_groups: Sequence[int] | None = None,
    ) -> None:
        """One cache per decoder layer of this pipeline stage, in layer order, the KV cache
        group of each decoder layer (global layer order; default: all 0) and the split-KV
        scratch they share; an empty list unbinds them all."""
        layer_ids = self.stage.layer_ids
        if kv_caches and len(kv_caches) != len(layer_ids):
            raise ValueError(
                f"kv_caches: expected one cache per decoder layer of this stage "
                f"({len(layer_ids)}), got {len(kv_caches)}"
            )
        for index, i in enumerate(layer_ids):
            attn = self.model.layers[i].self_attn.attn
            if kv_caches:
                group = 0 if kv_cache_groups is None else kv_cache_groups[i]
                attn.bind_kv_cache(kv_caches[index], split_kv_workspace, group)
            else:
                attn.unbind_kv_cache()

    def map_checkpoint_name(self, name: str) -> tuple[str, Hashable] | None:
        """HF checkpoint tensor name -> (parameter name, shard id), or None to skip it."""
        if "rotary_emb.inv_freq" in name:
            return None
        if self.arch.tie_word_embeddings and name == "lm_head.weight":
            return None
        for ckpt_part, param_part, shard_id in STACKED_PARAMS:
            if ckpt_part in name:
                return name.replace(ckpt_part, param_part), shard_id
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads HF-named tensors (those of this pipeline stage); returns the names of the
        parameters fully loaded."""
        return load_named_weights(dict(self.named_parameters()), weights, self._map_stage_name)

    def _map_stage_name(self, name: str) -> tuple[str, Hashable] | None:
        target = self.map_checkpoint_name(name)
        if target is None or self.stage.holds_parameter(target[0]):
            return target
        if target[0] == "model.embed_tokens.weight" and self.arch.tie_word_embeddings:
            # A last stage without the embedding holds its own copy of the tied head.
            return ("lm_head.weight", target[1]) if self.lm_head is not None else None
        return None
