"""The Gluon kernel of fp8_gemm_wgmma (see there): imports Gluon's Hopper API, so only
fp8_gemm_wgmma imports it, where that API exists. `launch` expects operands already checked."""

from __future__ import annotations

import functools

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

GROUP = gl.constexpr(128)
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
OUT_DTYPES = tuple(_GL_DTYPES)


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


@gluon.jit
def _retire_step(
    acc, product, scale, PENDING: gl.constexpr, a_desc, w_desc, a_bufs, w_bufs, bars, off_m,
    off_n, done, num_groups, NUM_STAGES: gl.constexpr,
):  # fmt: skip
    """Waits until at most PENDING products are in flight (step `done`'s is complete), scales
    it into acc, and refills its buffers. Returns acc."""
    product = warpgroup_mma_wait(num_outstanding=PENDING, deps=(product,))
    acc += product * scale[:, None]
    _refill(a_desc, w_desc, a_bufs, w_bufs, bars, off_m, off_n, done, num_groups, NUM_STAGES)
    return acc


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
    # UNROLL steps an iteration: step j's product is scaled into acc while step j + 1's runs. The
    # last step's product is waited for inside the iteration: one in flight across the back edge
    # would copy registers a wgmma still writes, and ptxas would then serialize all its wgmmas.
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
            acc = _retire_step(
                acc, product, scale, 1, a_desc, w_desc, a_bufs, w_bufs, bars, off_m, off_n,
                kb0 + j - 1, num_groups, NUM_STAGES,
            )  # fmt: skip
            product = next_product
            scale = next_scale
        acc = _retire_step(
            acc, product, scale, 0, a_desc, w_desc, a_bufs, w_bufs, bars, off_m, off_n,
            kb0 + UNROLL - 1, num_groups, NUM_STAGES,
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


@functools.cache
def _shared_layout(block: tuple[int, int], dtype) -> gl.NVMMASharedLayout:
    """The TMA tile's swizzled layout (immutable; computing it is most of a descriptor's host
    time, and eager steps build three descriptors a linear layer)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), dtype)


def _descriptor(t: torch.Tensor, block: tuple[int, int], dtype) -> TensorDescriptor:
    return TensorDescriptor(
        t, list(t.shape), list(t.stride()), list(block), _shared_layout(block, dtype)
    )


def launch(
    out: torch.Tensor,  # [M, N] bf16/fp16, M >= 1
    a: torch.Tensor,
    a_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    unroll: int,
) -> None:
    m, k = a.shape
    n = weight.shape[0]
    a_desc = _descriptor(a, (block_m, GROUP.value), gl.float8e4nv)
    w_desc = _descriptor(weight, (block_n, GROUP.value), gl.float8e4nv)
    out_desc = _descriptor(out, (block_m, block_n), _GL_DTYPES[out.dtype])
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _w8a8_block_wgmma_kernel[grid](
        a_desc, w_desc, out_desc, a_scale, w_scale, bias if bias is not None else w_scale,
        m, n, k, a_scale.stride(0),
        HAS_BIAS=bias is not None, NUM_STAGES=num_stages, UNROLL=_unroll(k // GROUP.value, unroll),
        num_warps=num_warps,
    )  # fmt: skip
