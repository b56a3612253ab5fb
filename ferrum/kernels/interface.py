"""The one kernel interface the model layers are built with, twice: `triton_kernels()` (the Triton
launchers) and `torch_kernels()` (the `*_ref.py` references, adapted to the launchers' signatures:
in place where the launcher is, host copies of index tensors where a reference loops on the host).
Layers never branch on the set; they ask `is_triton` only where the two can do different things.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ferrum.kernels.activation_ref import silu_and_mul_ref
from ferrum.kernels.attention_ref import paged_attention_ref, write_kv_cache_ref
from ferrum.kernels.causal_conv1d_ref import causal_conv1d_prefill_ref, causal_conv1d_update_ref
from ferrum.kernels.fused_moe_ref import fused_moe_ref, select_experts
from ferrum.kernels.gated_delta_rule_ref import (
    gated_delta_rule_decode_ref,
    gated_delta_rule_prefill_ref,
)
from ferrum.kernels.int4_ref import int4_linear_ref
from ferrum.kernels.rms_norm_ref import fused_add_rms_norm_ref, rms_norm_ref
from ferrum.kernels.rotary_kv_ref import qk_norm_rope_ref

if TYPE_CHECKING:
    from ferrum.kernels.fp8_quant import Fp8GroupRows


@dataclass(frozen=True, slots=True)
class Kernels:
    """The ops the layers call, each with its Triton launcher's signature (ferrum/kernels/)."""

    # The Triton launchers: no host syncs (CUDA-graph safe), FP8 rows written beside the norm,
    # SiLU-and-mul and attention outputs, SDPA for long prompt chunks. The references: none.
    is_triton: bool
    rms_norm: Callable[..., torch.Tensor]
    fused_add_rms_norm: Callable[..., None]
    rms_norm_fp8: Callable[..., tuple[torch.Tensor, Fp8GroupRows]]
    fused_add_rms_norm_fp8: Callable[..., Fp8GroupRows]
    silu_and_mul: Callable[..., torch.Tensor]
    silu_and_mul_fp8: Callable[..., tuple[torch.Tensor, Fp8GroupRows]]
    rotary_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    moe_router: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    fused_moe: Callable[..., torch.Tensor]
    dense_linear: Callable[..., torch.Tensor]
    fp8_block_linear: Callable[..., torch.Tensor]
    fp8_block_linear_takes_rows: Callable[..., bool]
    fp8_channel_linear: Callable[..., torch.Tensor]
    causal_conv1d_prefill: Callable[..., torch.Tensor]
    causal_conv1d_update: Callable[..., torch.Tensor]
    gated_delta_rule_prefill: Callable[..., torch.Tensor]
    gated_delta_rule_decode: Callable[..., torch.Tensor]
    int4_linear: Callable[..., torch.Tensor]
    # Every op gives a row the same bits whatever the batch (batch_invariant.py).
    batch_invariant: bool = False


def triton_kernels() -> Kernels:
    """The Triton launchers (imports triton)."""
    from ferrum.kernels import activation, fused_moe, moe_router, paged_attention, rms_norm
    from ferrum.kernels.causal_conv1d import causal_conv1d_prefill, causal_conv1d_update
    from ferrum.kernels.dense_linear import dense_linear
    from ferrum.kernels.fp8_linear import (
        block_linear_takes_fp8_rows,
        fp8_block_linear,
        fp8_channel_linear,
    )
    from ferrum.kernels.gated_delta_rule_decode import gated_delta_rule_decode
    from ferrum.kernels.gated_delta_rule_prefill import gated_delta_rule_prefill
    from ferrum.kernels.int4_linear import int4_linear
    from ferrum.kernels.rotary_kv import rotary_kv

    return Kernels(
        is_triton=True,
        rms_norm=rms_norm.rms_norm,
        fused_add_rms_norm=rms_norm.fused_add_rms_norm,
        rms_norm_fp8=rms_norm.rms_norm_fp8,
        fused_add_rms_norm_fp8=rms_norm.fused_add_rms_norm_fp8,
        silu_and_mul=activation.silu_and_mul,
        silu_and_mul_fp8=activation.silu_and_mul_fp8,
        rotary_kv=rotary_kv,
        paged_attention=paged_attention.paged_attention,
        moe_router=moe_router.moe_router,
        fused_moe=fused_moe.fused_moe,
        dense_linear=dense_linear,
        fp8_block_linear=fp8_block_linear,
        fp8_block_linear_takes_rows=block_linear_takes_fp8_rows,
        fp8_channel_linear=fp8_channel_linear,
        causal_conv1d_prefill=causal_conv1d_prefill,
        causal_conv1d_update=causal_conv1d_update,
        gated_delta_rule_prefill=gated_delta_rule_prefill,
        gated_delta_rule_decode=gated_delta_rule_decode,
        int4_linear=int4_linear,
    )


def torch_kernels() -> Kernels:
    """The torch references (no triton import: the FP8 ones import it when first called)."""
    return Kernels(
        is_triton=False,
        rms_norm=rms_norm_ref,
        fused_add_rms_norm=_fused_add_rms_norm,
        rms_norm_fp8=_no_fp8_rows,
        fused_add_rms_norm_fp8=_no_fp8_rows,
        silu_and_mul=silu_and_mul_ref,
        silu_and_mul_fp8=_no_fp8_rows,
        rotary_kv=_rotary_kv,
        paged_attention=host_paged_attention(paged_attention_ref),
        moe_router=select_experts,
        fused_moe=fused_moe_ref,
        dense_linear=torch.nn.functional.linear,
        fp8_block_linear=_fp8_linear(block_scales=True),
        fp8_block_linear_takes_rows=lambda *args: False,  # the reference quantizes x itself
        fp8_channel_linear=_fp8_linear(block_scales=False),
        causal_conv1d_prefill=_causal_conv1d_prefill,
        causal_conv1d_update=causal_conv1d_update_ref,
        gated_delta_rule_prefill=_gated_delta_rule_prefill,
        gated_delta_rule_decode=gated_delta_rule_decode_ref,
        int4_linear=int4_linear_ref,
    )


def _no_fp8_rows(*args: Any, **kwargs: Any) -> Any:
    raise ValueError("FP8 rows need the Triton kernel backend")


def _fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place, as the launcher: x := rms_norm(x + residual), residual := x + residual."""
    normed, summed = fused_add_rms_norm_ref(x, residual, weight, eps)
    x.copy_(normed)
    residual.copy_(summed)


def _rotary_kv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> None:
    """query and key normed (where a weight is given) and rotated in place; the rotated keys
    and the values written to their slots of the cache."""
    q, k = qk_norm_rope_ref(query, key, cos, sin, q_norm_weight, k_norm_weight, eps)
    query.copy_(q)
    key.copy_(k)
    write_kv_cache_ref(k, value, kv_cache, slot_mapping)


def host_paged_attention(ref: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`paged_attention`'s launcher signature over a reference taking host lists (`ref`:
    attention_ref's)."""

    def attention(
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        max_query_len: int,
        max_seq_len: int,
        scale: float,
        out: torch.Tensor,
        workspace: None = None,
        sliding_window: int | None = None,
        out_fp8: None = None,
    ) -> torch.Tensor:
        """Into `out`. Bounds, split-KV workspace and FP8 rows are the launcher's alone (the
        runner allocates no workspace and the layer asks no rows of the references)."""
        starts, lens = query_start_loc.tolist(), seq_lens.tolist()
        return out.copy_(ref(query, kv_cache, block_tables, starts, lens, scale, sliding_window))

    return attention


def _causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slot_ids: torch.Tensor,
    max_seq_len: int,
) -> torch.Tensor:
    """Every sequence starts from its slot's state; SiLU (the launcher's defaults)."""
    starts, slots = cu_seqlens.tolist(), slot_ids.tolist()
    return causal_conv1d_prefill_ref(x, weight, bias, conv_state_pool, starts, slots, None, "silu")


def _gated_delta_rule_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> torch.Tensor:
    """Every sequence starts from its slot's state."""
    starts, slots = cu_seqlens.tolist(), slot_ids.tolist()
    return gated_delta_rule_prefill_ref(
        q, k, v, g, beta, starts, state_pool, slots, None, scale, use_qk_l2norm
    )


def _fp8_linear(block_scales: bool) -> Callable[..., torch.Tensor]:
    """`fp8_linear_ref`, imported at the first call (its FP8 constants import triton)."""

    def linear(*args: Any) -> torch.Tensor:
        from ferrum.kernels.fp8_gemm_ref import fp8_linear_ref

        return fp8_linear_ref(*args, block_scales=block_scales)

    return linear
