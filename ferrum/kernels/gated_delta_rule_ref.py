"""Torch reference for the gated delta rule (gated DeltaNet): the CPU path and the Triton kernels'
oracle. Per value head, state S [k_dim, v_dim], each token t, fp32 math:
    q_t, k_t = l2norm(q_t), l2norm(k_t)      (use_qk_l2norm; x * rsqrt(sum(x^2) + 1e-6))
    S = exp(g_t) * S                         (g_t <= 0: log decay)
    S += k_t (beta_t * (v_t - S^T k_t))^T    (delta rule: write the correction at rate beta_t)
    o_t = S^T (scale * q_t)                  (scale defaults to k_dim ** -0.5)
Value head h reads q/k head h // (num_v_heads // num_k_heads): transformers'
`torch_recurrent_gated_delta_rule`. Pool layout: `[num_slots, num_v_heads, k_dim, v_dim]`."""

from __future__ import annotations

import torch

L2NORM_EPS = 1e-6


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def gated_delta_rule_ref(
    q: torch.Tensor,  # [seq_len, num_k_heads, k_dim]
    k: torch.Tensor,  # [seq_len, num_k_heads, k_dim]
    v: torch.Tensor,  # [seq_len, num_v_heads, v_dim]
    g: torch.Tensor,  # [seq_len, num_v_heads]
    beta: torch.Tensor,  # [seq_len, num_v_heads]
    initial_state: torch.Tensor | None = None,  # [num_v_heads, k_dim, v_dim]
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: returns (out [seq_len, num_v_heads, v_dim] in v's dtype, final state fp32)."""
    num_v_heads, v_dim = v.shape[1], v.shape[2]
    k_dim = k.shape[2]
    group = num_v_heads // k.shape[1]
    qf = q.float().repeat_interleave(group, dim=1)
    kf = k.float().repeat_interleave(group, dim=1)
    if use_qk_l2norm:
        qf, kf = _l2norm(qf), _l2norm(kf)
    qf = qf * (k_dim**-0.5 if scale is None else scale)
    vf, gf, bf = v.float(), g.float(), beta.float()
    if initial_state is None:
        state = torch.zeros(num_v_heads, k_dim, v_dim, dtype=torch.float32, device=v.device)
    else:
        state = initial_state.float().clone()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(v.shape[0]):
        state = state * gf[t].exp()[:, None, None]
        kv_mem = torch.einsum("hkv,hk->hv", state, kf[t])
        delta = (vf[t] - kv_mem) * bf[t][:, None]
        state = state + kf[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", state, qf[t])
    return out.to(v.dtype), state


def gated_delta_rule_decode_ref(
    q: torch.Tensor,  # [num_reqs, num_k_heads, k_dim]
    k: torch.Tensor,  # [num_reqs, num_k_heads, k_dim]
    v: torch.Tensor,  # [num_reqs, num_v_heads, v_dim]
    g: torch.Tensor,  # [num_reqs, num_v_heads]
    beta: torch.Tensor,  # [num_reqs, num_v_heads]
    state_pool: torch.Tensor,  # [num_slots, num_v_heads, k_dim, v_dim], updated at slot_ids
    slot_ids: torch.Tensor,  # [num_reqs] int; < 0: padding (zero output, no state)
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    dst_slot_ids: torch.Tensor | None = None,  # [num_reqs] int; None: slot_ids
) -> torch.Tensor:
    """One recurrent step per request (token i is request i's only token), batched; the new
    state goes to dst_slot_ids[i] when given, else back to slot_ids[i]."""
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    live = (slot_ids >= 0).nonzero().flatten()
    if live.numel() == 0:
        return out
    slots = slot_ids[live].long()
    group = v.shape[1] // k.shape[1]
    qf = q[live].float().repeat_interleave(group, dim=1)
    kf = k[live].float().repeat_interleave(group, dim=1)
    if use_qk_l2norm:
        qf, kf = _l2norm(qf), _l2norm(kf)
    qf = qf * (k.shape[2] ** -0.5 if scale is None else scale)
    state = state_pool[slots].float() * g[live].float().exp()[:, :, None, None]
    kv_mem = torch.einsum("nhkv,nhk->nhv", state, kf)
    delta = (v[live].float() - kv_mem) * beta[live].float()[:, :, None]
    state = state + kf[:, :, :, None] * delta[:, :, None, :]
    out[live] = torch.einsum("nhkv,nhk->nhv", state, qf).to(v.dtype)
    dst = slots if dst_slot_ids is None else dst_slot_ids[live].long()
    state_pool[dst] = state.to(state_pool.dtype)
    return out


def gated_delta_rule_prefill_ref(
    q: torch.Tensor,  # [num_tokens, num_k_heads, k_dim]
    k: torch.Tensor,  # [num_tokens, num_k_heads, k_dim]
    v: torch.Tensor,  # [num_tokens, num_v_heads, v_dim]
    g: torch.Tensor,  # [num_tokens, num_v_heads]
    beta: torch.Tensor,  # [num_tokens, num_v_heads]
    cu_seqlens: list[int],  # [num_seqs + 1], host
    state_pool: torch.Tensor,  # [num_slots, num_v_heads, k_dim, v_dim], updated at slot_ids
    slot_ids: list[int],  # [num_seqs], host; < 0: padding (zero output, no state)
    has_initial_state: list[bool] | None = None,  # [num_seqs]; None: every sequence has one
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> torch.Tensor:
    """Sequence i (tokens cu_seqlens[i]:cu_seqlens[i+1]) starts from state_pool[slot_ids[i]]
    (zeros where has_initial_state[i] is False) and writes its final state back there."""
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    for i, slot in enumerate(slot_ids):
        start, end = cu_seqlens[i], cu_seqlens[i + 1]
        if slot < 0 or end == start:
            continue
        has_init = has_initial_state is None or has_initial_state[i]
        init = state_pool[slot] if has_init else None
        out[start:end], final = gated_delta_rule_ref(
            q[start:end],
            k[start:end],
            v[start:end],
            g[start:end],
            beta[start:end],
            init,
            scale,
            use_qk_l2norm,
        )
        state_pool[slot] = final.to(state_pool.dtype)
    return out
