"""Torch reference for the short causal depthwise conv1d with per-request state (before gated
DeltaNet): the CPU path and the Triton kernels' oracle. Channel c, width-W weight w, fp32 math:
    y_t = act(bias_c + sum_{j<W} w[c, j] * x_{t - W + 1 + j})      (act: SiLU or identity)
where positions before the sequence read the slot's conv state (zeros without one): the last W - 1
inputs, oldest first, as transformers' `causal_conv1d_fn` / `_update` (whose state keeps one more
input no output reads). Pool layout: `[num_slots, W - 1, dim]`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "silu")


def causal_conv1d_ref(
    x: torch.Tensor,  # [seq_len, dim]
    weight: torch.Tensor,  # [dim, width]
    bias: torch.Tensor | None,  # [dim]
    conv_state: torch.Tensor | None,  # [width - 1, dim]; None: zeros
    activation: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: returns (y [seq_len, dim] in x's dtype, new conv state [width - 1, dim])."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    dim, width = weight.shape
    if conv_state is None:
        conv_state = torch.zeros(width - 1, dim, dtype=x.dtype, device=x.device)
    padded = torch.cat([conv_state.to(x.dtype), x]).float()  # [width - 1 + seq_len, dim]
    y = F.conv1d(padded.t()[None], weight.float()[:, None, :], groups=dim)[0].t()
    if bias is not None:
        y = y + bias.float()
    if activation == "silu":
        y = F.silu(y)
    return y.to(x.dtype), padded[padded.shape[0] - (width - 1) :].to(x.dtype)


def causal_conv1d_prefill_ref(
    x: torch.Tensor,  # [num_tokens, dim]
    weight: torch.Tensor,  # [dim, width]
    bias: torch.Tensor | None,  # [dim]
    conv_state_pool: torch.Tensor,  # [num_slots, width - 1, dim], updated at slot_ids
    cu_seqlens: list[int],  # [num_seqs + 1], host
    slot_ids: list[int],  # [num_seqs], host; < 0: padding (zero output, no state)
    has_initial_state: list[bool] | None = None,  # [num_seqs]; None: every sequence has one
    activation: str | None = "silu",
) -> torch.Tensor:
    """Sequence i (tokens cu_seqlens[i]:cu_seqlens[i+1]) starts from conv_state_pool[slot_ids[i]]
    (zeros where has_initial_state[i] is False) and writes its last width - 1 inputs back."""
    out = torch.zeros_like(x)
    for i, slot in enumerate(slot_ids):
        start, end = cu_seqlens[i], cu_seqlens[i + 1]
        if slot < 0 or end == start:
            continue
        has_init = has_initial_state is None or has_initial_state[i]
        state = conv_state_pool[slot] if has_init else None
        out[start:end], new_state = causal_conv1d_ref(x[start:end], weight, bias, state, activation)
        conv_state_pool[slot] = new_state
    return out


def causal_conv1d_update_ref(
    x: torch.Tensor,  # [num_reqs, dim], one token per request
    weight: torch.Tensor,  # [dim, width]
    bias: torch.Tensor | None,  # [dim]
    conv_state_pool: torch.Tensor,  # [num_slots, width - 1, dim], updated at slot_ids
    slot_ids: torch.Tensor,  # [num_reqs] int; < 0: padding (zero output, no state)
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode step per request: the prefill with every sequence one token long."""
    num_reqs = x.shape[0]
    return causal_conv1d_prefill_ref(
        x,
        weight,
        bias,
        conv_state_pool,
        list(range(num_reqs + 1)),
        slot_ids.tolist(),
        None,
        activation,
    )
