"""Small-batch fused mixture-of-experts (num_tokens <= SMALL_BATCH_MAX_TOKENS): two GEMV launches,
no token->expert align, since an expert sees one or a few tokens. Kernel 1, grid (num_pairs,
cdiv(I, BLOCK_N)): pair p = t * top_k + j's token against expert topk_ids[p]'s gate and up rows,
SiLU-and-mul -> act [T*k, I]. Kernel 2, grid (num_tokens, cdiv(H, BLOCK_N)): token t's k act rows
against their experts' down rows, summed weighted in order j = 0..k-1 in fp32 into out [T, H];
with DOWN_SPLIT a program a pair, the last of a tile's k to arrive (arrival_counters.py) summing in
order. Roundings as `fused_moe_ref`; sizes depend only on (T, k, E, H, I) (CUDA-graph safe). FP8
experts: the vector is scaled, x[k] * scale[e, n0 // 128, k // 128] against the FP8 codes (BLOCK_N
divides 128: a program's rows share one scale row)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels.arrival_counters import arrival_counters
from ferrum.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait
from ferrum.kernels.split_k_sum import last_to_arrive

# Batches of at most this many tokens take the small-batch GEMV path (no align).
SMALL_BATCH_MAX_TOKENS = 8
# Rows and columns of weight covered by one FP8 scale.
FP8_BLOCK = 128


@triton.jit
def _load_k_chunk(vec_ptrs, offs_k, k_left, n_mask, EVEN_K: tl.constexpr):
    """One BLOCK_K chunk of a GEMV's vector (in fp32) and the mask of the matching weight tile
    [BLOCK_N, BLOCK_K]; with EVEN_K (K a multiple of BLOCK_K) nothing is masked along K."""
    if EVEN_K:
        vec = tl.load(vec_ptrs).to(tl.float32)
        w_mask = n_mask[:, None]
    else:
        k_mask = offs_k < k_left
        vec = tl.load(vec_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        w_mask = n_mask[:, None] & k_mask[None, :]
    return vec, w_mask


@triton.jit
def _scale_chunk(vec, s_row, offs_k, k0, k_size):
    """The vector chunk [BLOCK_K] at columns k0 + offs_k times its 128-column blocks' scales in
    one row of block scales (or chunks [E, BLOCK_K] against rows s_row [E, 1], offs_k [1,
    BLOCK_K]); columns past k_size read no scale (the vector is zero there)."""
    return vec * tl.load(s_row + (k0 + offs_k) // 128, mask=offs_k < k_size - k0, other=0.0)


@triton.jit
def _moe_gate_up_gemv_kernel(
    act_ptr,  # [num_pairs, I]
    hidden_ptr,  # [num_tokens, H]
    w13_ptr,  # [E, 2I, H]
    w13_scale_ptr,  # [E, 2I / 128, H / 128] float32, read when W_FP8
    topk_ids_ptr,  # [num_pairs] int32/int64
    inter,
    hidden_size,
    top_k,
    num_experts,
    stride_hm,
    stride_we,
    stride_wn,
    stride_am,
    stride_se,
    stride_sn,
    W_FP8: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (p, n): act[p, n*BLOCK_N..] = silu(g) * u, (g, u) = w13[e, (n | I + n)] @ x[t] for
    t = p // top_k, e = topk_ids[p]. Products accumulate per lane in fp32, summed once at the end.
    A pair whose e lies outside [0, num_experts) reads no weights (its act row is zero)."""
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    pair = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    routed = (expert >= 0) & (expert < num_experts)
    expert = tl.where(routed, expert, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = hidden_ptr + (pair // top_k) * stride_hm + offs_k
    # FP8 weight columns are read 8 to a thread, as the 16-bit vector is, so the vector chunk
    # already lies in the tile's column layout (no step moves it between threads).
    w_cols = tl.max_contiguous(offs_k, 8)
    w_ptrs = (
        w13_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + w_cols[None, :]
    )
    up_offset = inter * stride_wn
    s_row = w13_scale_ptr + expert * stride_se + ((pid_n * BLOCK_N) // 128) * stride_sn
    s_up_row = s_row + (inter // 128) * stride_sn
    dtype = hidden_ptr.dtype.element_ty
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        x, w_mask = _load_k_chunk(x_ptrs, offs_k, hidden_size - k0, n_mask, EVEN_K)
        w_mask = w_mask & routed
        gate = tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        up = tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0).to(tl.float32)
        if W_FP8:
            acc_gate += gate * _scale_chunk(x, s_row, offs_k, k0, hidden_size)[None, :]
            acc_up += up * _scale_chunk(x, s_up_row, offs_k, k0, hidden_size)[None, :]
        else:
            acc_gate += gate * x[None, :]
            acc_up += up * x[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    gate = tl.sum(acc_gate, 1).to(dtype).to(tl.float32)
    up = tl.sum(acc_up, 1).to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(act_ptr + pair * stride_am + offs_n, (act * up).to(dtype), mask=n_mask)


@triton.jit
def _moe_down_combine_gemv_kernel(
    out_ptr,  # [num_tokens, H]
    act_ptr,  # [num_pairs, I]
    w2_ptr,  # [E, H, I]
    w2_scale_ptr,  # [E, H / 128, I / 128] float32, read when W_FP8
    topk_weights_ptr,  # [num_pairs] float32
    topk_ids_ptr,  # [num_pairs] int32/int64
    hidden_size,
    inter,
    top_k,
    num_experts,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    stride_se,
    stride_sn,
    W_FP8: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (t, n): out[t, n*BLOCK_N..] = sum over j = 0..k-1 in order, in fp32, of
    topk_weights[p] * round(w2[e] @ act[p]) for p = t * top_k + j, e = topk_ids[p]; pairs
    whose e lies outside [0, num_experts) read no weights and add zero.

    BLOCK_E choices are one axis of the tile: each K step reads their experts' [BLOCK_N, BLOCK_K]
    weight tiles together, so that no choice of the group waits for the one before it."""
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden_size
    offs_k = tl.arange(0, BLOCK_K)
    rows_e = tl.arange(0, BLOCK_E)
    dtype = act_ptr.dtype.element_ty
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j0 in range(0, top_k, BLOCK_E):
        choice = j0 + rows_e < top_k
        pairs = token * top_k + j0 + rows_e
        experts = tl.load(topk_ids_ptr + pairs, mask=choice, other=-1).to(tl.int64)
        routed = (experts >= 0) & (experts < num_experts)
        experts = tl.where(routed, experts, 0)
        a_ptrs = act_ptr + pairs[:, None] * stride_am + offs_k[None, :]
        # FP8 columns are read 16 a thread here (not 8 as in the gate/up kernel): reading 8 left
        # the act chunk's move between threads in place (ptxas, sm90) and cost registers.
        w_ptrs = (
            w2_ptr
            + experts[:, None, None] * stride_we
            + offs_n[None, :, None].to(tl.int64) * stride_wn
            + offs_k[None, None, :]
        )
        w_tile_mask = routed[:, None, None] & n_mask[None, :, None]
        s_rows = (
            w2_scale_ptr + experts[:, None] * stride_se + ((pid_n * BLOCK_N) // 128) * stride_sn
        )
        acc = tl.zeros((BLOCK_E, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            if EVEN_K:
                a_mask = routed[:, None]
                w_mask = w_tile_mask
            else:
                k_mask = offs_k < inter - k0
                a_mask = routed[:, None] & k_mask[None, :]
                w_mask = w_tile_mask & k_mask[None, None, :]
            a = tl.load(a_ptrs, mask=a_mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32)
            if W_FP8:
                a = _scale_chunk(a, s_rows, offs_k[None, :], k0, inter)
            acc += w * a[:, None, :]
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        y = tl.sum(acc, 2).to(dtype).to(tl.float32)  # [BLOCK_E, BLOCK_N]: choice j0 + i in row i
        weighted = y * tl.load(topk_weights_ptr + pairs, mask=choice, other=0.0)[:, None]
        # In order: row i picked out exactly (one term plus zeros), then added.
        for i in tl.static_range(BLOCK_E):
            total += tl.sum(tl.where(rows_e[:, None] == i, weighted, 0.0), 0)
    tl.store(out_ptr + token * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _moe_down_split_gemv_kernel(
    out_ptr,  # [num_tokens, H]
    partial_ptr,  # [num_pairs, H] float32
    counter_ptr,  # [>= num_tokens * cdiv(H, BLOCK_N)] int32, zero between launches
    act_ptr,  # [num_pairs, I]
    w2_ptr,  # [E, H, I]
    w2_scale_ptr,  # [E, H / 128, I / 128] float32, read when W_FP8
    topk_weights_ptr,  # [num_pairs] float32
    topk_ids_ptr,  # [num_pairs] int32/int64
    hidden_size,
    inter,
    top_k,
    num_experts,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    stride_se,
    stride_sn,
    W_FP8: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (p, n): partial[p, n*BLOCK_N..] = topk_weights[p] * round(w2[e] @ act[p]) in fp32
    for e = topk_ids[p] (zero when e lies outside [0, num_experts)); the last of token t's k
    programs of tile n to arrive writes out[t, n*BLOCK_N..] = the sum of its partials in order
    j = 0..k-1 and resets the tile's counter."""
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    pair = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    token = pair // top_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden_size
    offs_k = tl.arange(0, BLOCK_K)
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    routed = (expert >= 0) & (expert < num_experts)
    expert = tl.where(routed, expert, 0)
    a_ptrs = act_ptr + pair * stride_am + offs_k
    w_ptrs = (
        w2_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    )
    s_row = w2_scale_ptr + expert * stride_se + ((pid_n * BLOCK_N) // 128) * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        a, w_mask = _load_k_chunk(a_ptrs, offs_k, inter - k0, n_mask & routed, EVEN_K)
        w = tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        if W_FP8:
            a = _scale_chunk(a, s_row, offs_k, k0, inter)
        acc += w * a[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y = tl.sum(acc, 1).to(act_ptr.dtype.element_ty).to(tl.float32)
    weighted = y * tl.load(topk_weights_ptr + pair)
    tl.store(partial_ptr + pair * hidden_size + offs_n, weighted, mask=n_mask)
    counter = counter_ptr + token * tl.num_programs(1) + pid_n
    if last_to_arrive(counter, top_k):
        rows = partial_ptr + token * top_k * hidden_size + offs_n
        total = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in range(0, top_k):
            total += tl.load(rows + j * hidden_size, mask=n_mask, other=0.0, cache_modifier=".cg")
        out = total.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + token * stride_om + offs_n, out, mask=n_mask)
        tl.store(counter, 0)


def _gemv_tiles(
    config: dict[str, int], prefix: str, n: int, k: int, fp8: bool
) -> tuple[int, int, bool]:
    """(BLOCK_N, BLOCK_K, EVEN_K) of one GEMV: blocks shrunk to the (power-of-two padded) dims,
    BLOCK_N to one scale block of rows for FP8 weights."""
    block_n = min(config[f"{prefix}_BLOCK_N"], triton.next_power_of_2(n))
    block_k = min(config[f"{prefix}_BLOCK_K"], triton.next_power_of_2(k))
    if fp8:
        block_n = min(block_n, FP8_BLOCK)
    return block_n, block_k, k % block_k == 0


def _gate_up_gemv(
    act: torch.Tensor,  # [num_pairs, I]
    hidden: torch.Tensor,  # [num_tokens, H]
    w13: torch.Tensor,  # [E, 2I, H]
    s13: torch.Tensor,  # w13's block scales, or w13 itself when not FP8
    flat_ids: torch.Tensor,  # [num_pairs]
    top_k: int,
    config: dict[str, int],
    fp8: bool,
    launch: dict[str, int | bool],
) -> None:
    """Launches kernel 1: act[p] = silu(gate) * up of pair p's token against its expert."""
    num_pairs, inter = act.shape
    hidden_size = hidden.shape[1]
    block_n, block_k, even_k = _gemv_tiles(config, "GATE_UP", inter, hidden_size, fp8)
    _moe_gate_up_gemv_kernel[(num_pairs, triton.cdiv(inter, block_n))](
        act,
        hidden,
        w13,
        s13,
        flat_ids,
        inter,
        hidden_size,
        top_k,
        w13.shape[0],
        hidden.stride(0),
        w13.stride(0),
        w13.stride(1),
        act.stride(0),
        s13.stride(0),
        s13.stride(1),
        W_FP8=fp8,
        EVEN_K=even_k,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        **launch,
    )


def small_batch_moe(
    out: torch.Tensor,
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    flat_weights: torch.Tensor,
    flat_ids: torch.Tensor,
    top_k: int,
    config: dict[str, int],
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> None:
    """Two GEMV launches: gate/up + SiLU-and-mul per pair, then down + weighted sum per token.
    With the scales, w13 and w2 are FP8 (see the module docstring)."""
    num_tokens, hidden_size = hidden.shape
    num_pairs = flat_ids.numel()
    inter = w2.shape[2]
    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    launch = {
        "num_warps": config["num_warps"],
        "num_stages": config["num_stages"],
        **pdl_launch_args(hidden.device),
    }
    fp8 = w13_scale is not None
    s13 = w13 if w13_scale is None else w13_scale
    s2 = w2 if w2_scale is None else w2_scale

    # Pairs (tokens in the down GEMV) vary fastest across programs, so pairs sharing an expert
    # read the same weight rows close together in time and hit L2.
    _gate_up_gemv(act, hidden, w13, s13, flat_ids, top_k, config, fp8, launch)
    block_n, block_k, even_k = _gemv_tiles(config, "DOWN", hidden_size, inter, fp8)
    down_args = (
        act, w2, s2, flat_weights, flat_ids, hidden_size, inter, top_k, w2.shape[0], act.stride(0),
        w2.stride(0), w2.stride(1), out.stride(0), s2.stride(0), s2.stride(1),
    )  # fmt: skip
    tiles = dict(W_FP8=fp8, EVEN_K=even_k, BLOCK_N=block_n, BLOCK_K=block_k, **launch)
    num_n_tiles = triton.cdiv(hidden_size, block_n)
    if config.get("DOWN_SPLIT", 0):
        if config.get("DOWN_BLOCK_E", 1) != 1:
            raise ValueError(
                f"small_config: DOWN_SPLIT 1 runs one choice a program: DOWN_BLOCK_E must be 1, "
                f"got {config['DOWN_BLOCK_E']}"
            )
        partial = torch.empty(num_pairs, hidden_size, dtype=torch.float32, device=out.device)
        counters = arrival_counters(out.device, num_tokens * num_n_tiles, "fused MoE down GEMV")
        _moe_down_split_gemv_kernel[(num_pairs, num_n_tiles)](
            out, partial, counters, *down_args, **tiles
        )
        return
    block_e = min(config.get("DOWN_BLOCK_E", 1), triton.next_power_of_2(top_k))
    _moe_down_combine_gemv_kernel[(num_tokens, num_n_tiles)](
        out, *down_args, BLOCK_E=block_e, **tiles
    )
