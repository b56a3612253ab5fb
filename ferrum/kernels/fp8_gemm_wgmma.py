"""Hopper W8A8 FP8 GEMM with block scales, written in Gluon: out = A @ W^T, bf16/fp16 out.

A [M, K] FP8 codes with a_scale [M, K / 128] (one scale a row and group of 128 columns), W [N, K]
FP8 with w_scale [ceil(N / 128), K / 128] (one scale a 128x128 block). Each K step of 128 adds
    acc[m, n] += (sum_k a[m, k] w[n, k]) * (a_scale[m, kb] * w_scale[n // 128, kb]).

Why Gluon: the product of a K step has to be complete before its scales apply, and Triton's
tl.dot pipeliner waits for each wgmma right after issuing it, so the tensor cores idle while the
scales are applied. Here each step issues its wgmma asynchronously, then waits only for the
previous step's (`warpgroup_mma_wait(num_outstanding=1)`) and scales that one into the
accumulator while the new one runs. TMA loads run NUM_STAGES steps ahead.

Invariants: BLOCK_K == 128 (one scale group a step); BLOCK_N divides 128, so a tile's columns
share one weight block and its scale is one scalar a step; K % 128 == 0. Rows and columns past
M and N are zero-filled by TMA on load and clipped on store. Measured against cuBLASLt and the
Triton GEMM in benchmarks/RESULTS.md (2026-11-28); the tuned buckets pick it per shape and M.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ferrum.kernels import cuda_capability
from ferrum.kernels.fp8_gemm import check_fp8_operands
from ferrum.kernels.fp8_gemm_config import check_wgmma_tile

GROUP = gl.constexpr(128)
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@gluon.constexpr_function
def _warps_per_cta(BLOCK_M, num_warps):
    """[warps along M, warps along N]: the [4, 1] warpgroup atom tiled along M while each warp
    keeps at least 16 rows, then along N."""
    warps = [4, 1]
    while warps[0] * warps[1] != num_warps:
        if 16 * warps[0] < BLOCK_M:
            warps[0] *= 2
        else:
            warps[1] *= 2
    return warps


@gluon.constexpr_function
def _instr_n(BLOCK_M, BLOCK_N, num_warps):
    """The widest wgmma N (a multiple of 8, at most 256) dividing the tile's per-warp columns."""
    n_reps = triton.cdiv(num_warps, triton.cdiv(BLOCK_M, 16))
    max_n = max(BLOCK_N // n_reps, 8)
    n = 256
    while n > max_n or BLOCK_N % n != 0:
        n -= 8
    return n


@gluon.jit
def _load_step(a_desc, w_desc, bar, a_buf, w_buf, off_m, off_n, k, pred):
    mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_buf, pred=pred)
    tma.async_copy_global_to_shared(w_desc, [off_n, k], bar, w_buf, pred=pred)


@gluon.jit
def _refill(
    a_desc, w_desc, a_bufs, w_bufs, bars, off_m, off_n, done, num_groups, NUM_STAGES: gl.constexpr
):
    """Step `done`'s product is complete, so its buffers take step done + NUM_STAGES's tiles."""
    stage = done % NUM_STAGES
    step = done + NUM_STAGES
    _load_step(
        a_desc, w_desc, bars.index(stage), a_bufs.index(stage), w_bufs.index(stage),
        off_m, off_n, step * GROUP, step < num_groups,
    )  # fmt: skip


@gluon.jit
def _step_scale(a_scale_ptr, w_scale_ptr, offs_m, mask_m, stride_asm, w_row, num_groups, kb):
    """a_scale[m, kb] * w_scale[tile's block, kb] as [BLOCK_M] in the accumulator's row layout."""
    a_s = gl.load(a_scale_ptr + offs_m * stride_asm + kb, mask=mask_m, other=0.0)
    return a_s * gl.load(w_scale_ptr + w_row * num_groups + kb)


@gluon.jit
def _issue_step(a_bufs, w_bufs, bars, like, kb, NUM_STAGES: gl.constexpr):
    """Waits for step kb's tiles and issues their product asynchronously into fresh registers."""
    stage = kb % NUM_STAGES
    mbarrier.wait(bars.index(stage), (kb // NUM_STAGES) & 1)
    return warpgroup_mma(
        a_bufs.index(stage),
        w_bufs.index(stage).permute((1, 0)),
        gl.zeros_like(like),  # ignored (use_acc=False)
        use_acc=False,
        is_async=True,
    )


# M is the step's row count: not specialised, so no row count compiles a variant warm-up missed.
@gluon.jit(do_not_specialize=("M",))
def _w8a8_block_wgmma_kernel(
    a_desc,  # [M, K] fp8, blocks [BLOCK_M, 128]
    w_desc,  # [N, K] fp8, blocks [BLOCK_N, 128]
    out_desc,  # [M, N] bf16/fp16, blocks [BLOCK_M, BLOCK_N]
    a_scale_ptr,  # [M, K / 128] fp32, row stride stride_asm
    w_scale_ptr,  # [ceil(N / 128), K / 128] fp32, contiguous
    bias_ptr,  # [N], read when HAS_BIAS
    M,
    N,
    K,
    stride_asm,
    HAS_BIAS: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    UNROLL: gl.constexpr,  # divides K / 128
    num_warps: gl.constexpr,
):
    BLOCK_M: gl.constexpr = out_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    gl.static_assert(BLOCK_K == GROUP)
    gl.static_assert(GROUP % BLOCK_N == 0)

    # Row tiles vary fastest: the few row tiles of a decode batch read one weight tile together,
    # so it comes from HBM once.
    num_m_tiles = gl.cdiv(M, BLOCK_M)
    pid = gl.program_id(0)
    off_m = (pid % num_m_tiles) * BLOCK_M
    off_n = (pid // num_m_tiles) * BLOCK_N
    num_groups = K // BLOCK_K
    w_row = off_n // GROUP

    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0],
        warps_per_cta=_warps_per_cta(BLOCK_M, num_warps),
        instr_shape=[
            16,
            _instr_n(BLOCK_M, BLOCK_N, num_warps),
            256 // a_desc.dtype.primitive_bitwidth,
        ],
    )
    offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    mask_m = offs_m < M

    a_bufs = gl.allocate_shared_memory(
        a_desc.dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout
    )
    w_bufs = gl.allocate_shared_memory(
        w_desc.dtype, [NUM_STAGES] + w_desc.block_type.shape, w_desc.layout
    )
    bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(NUM_STAGES):
        _load_step(
            a_desc, w_desc, bars.index(s), a_bufs.index(s), w_bufs.index(s),
            off_m, off_n, s * BLOCK_K, s < num_groups,
        )  # fmt: skip

    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
    # UNROLL steps an iteration, unrolled: step j's product is scaled into acc while step j + 1's
    # runs. The last step's product is waited for inside the iteration, so no product is in
    # flight across the back edge (carrying one would copy registers a wgmma still writes, and
    # ptxas then serializes every wgmma of the kernel).
    for it in range(0, num_groups // UNROLL):
        kb0 = it * UNROLL
        scale = _step_scale(
            a_scale_ptr, w_scale_ptr, offs_m, mask_m, stride_asm, w_row, num_groups, kb0
        )
        product = _issue_step(a_bufs, w_bufs, bars, acc, kb0, NUM_STAGES)
        for j in gl.static_range(1, UNROLL):
            next_scale = _step_scale(
                a_scale_ptr, w_scale_ptr, offs_m, mask_m, stride_asm, w_row, num_groups, kb0 + j
            )
            next_product = _issue_step(a_bufs, w_bufs, bars, acc, kb0 + j, NUM_STAGES)
            product = warpgroup_mma_wait(num_outstanding=1, deps=(product,))
            acc += product * scale[:, None]
            _refill(
                a_desc, w_desc, a_bufs, w_bufs, bars, off_m, off_n, kb0 + j - 1, num_groups,
                NUM_STAGES,
            )  # fmt: skip
            product = next_product
            scale = next_scale
        product = warpgroup_mma_wait(num_outstanding=0, deps=(product,))
        acc += product * scale[:, None]
        _refill(
            a_desc, w_desc, a_bufs, w_bufs, bars, off_m, off_n, kb0 + UNROLL - 1, num_groups,
            NUM_STAGES,
        )  # fmt: skip
    for s in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(bars.index(s))

    if HAS_BIAS:
        offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        acc += gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)[None, :]
    out_buf = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
    out_buf.store(acc.to(out_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(out_desc, [off_m, off_n], out_buf)
    tma.store_wait(pendings=0)


def _unroll(num_groups: int, most: int) -> int:
    """The largest power of two up to `most` dividing the K steps."""
    unroll = most
    while num_groups % unroll:
        unroll //= 2
    return unroll


def _descriptor(t: torch.Tensor, block: list[int], dtype) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def wgmma_gemm_takes(device: torch.device, out_dtype: torch.dtype, n: int, k: int) -> bool:
    """Whether this kernel serves x [M, K] @ W[N, K]^T into out_dtype on this device: Hopper
    (wgmma is sm90 only), whole scale groups along K, 16-byte output rows for TMA."""
    return (
        device.type == "cuda"
        and out_dtype in _GL_DTYPES
        and k % GROUP.value == 0
        and n % 8 == 0
        and cuda_capability(device.index) == (9, 0)
    )


def w8a8_block_fp8_matmul_wgmma(
    a: torch.Tensor,  # [M, K] fp8, contiguous
    a_scale: torch.Tensor,  # [M, K / 128] fp32, contiguous
    weight: torch.Tensor,  # [N, K] fp8, contiguous
    w_scale: torch.Tensor,  # [ceil(N / 128), K / 128] fp32, contiguous
    out_dtype: torch.dtype,
    block_m: int = 64,
    block_n: int = 128,
    num_warps: int = 4,
    num_stages: int = 4,
    unroll: int = 2,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """[M, N] out_dtype; callers check `wgmma_gemm_takes` first."""
    m, n, k = check_fp8_operands(a, weight, w_scale, True, bias, out_dtype, a_scale)
    check_wgmma_tile(block_m, block_n, num_warps, num_stages, unroll)
    if not wgmma_gemm_takes(a.device, out_dtype, n, k):
        raise ValueError(
            f"the wgmma GEMM needs a Hopper GPU, a bf16/fp16 output, K % 128 == 0 and N % 8 == 0, "
            f"got {a.device} {out_dtype} N={n} K={k}"
        )
    for name, t in (("a", a), ("weight", weight)):
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"{name} must be contiguous and 16-byte aligned (TMA)")
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    a_desc = _descriptor(a, [block_m, GROUP.value], gl.float8e4nv)
    w_desc = _descriptor(weight, [block_n, GROUP.value], gl.float8e4nv)
    out_desc = _descriptor(out, [block_m, block_n], _GL_DTYPES[out_dtype])
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _w8a8_block_wgmma_kernel[grid](
        a_desc, w_desc, out_desc, a_scale, w_scale, bias if bias is not None else w_scale,
        m, n, k, a_scale.stride(0),
        HAS_BIAS=bias is not None, NUM_STAGES=num_stages, UNROLL=_unroll(k // GROUP.value, unroll),
        num_warps=num_warps,
    )  # fmt: skip
    return out
