"""All-reduce of small bf16 messages through torch symmetric memory (peer loads over NVLink).
On 2 H200s in a CUDA graph, [tokens, 4096] (RESULTS.md): one-shot 7.7 / 11.0 us at 1 / 64 tokens
vs NCCL's 9.3 / 12.9; two-shot 16.9 / 25.1 us at 256 / 512 vs 29.2 / 34.7. So messages up to
ONE_SHOT_MAX_BYTES go one-shot, up to MAX_BYTES two-shot (reduce-scatter, all-gather), larger on
NCCL; no multicast (off on the machines measured). Both ops are graph-capturable and end with a
barrier, so the one symmetric buffer is free for the next all-reduce on the stream."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ferrum.logger import init_logger

logger = init_logger(__name__)

ONE_SHOT_MAX_BYTES = 512 * 1024
MAX_BYTES = 4 * 1024 * 1024
DTYPE = torch.bfloat16


class SymmMemAllReduce:
    """Sums a bf16 CUDA tensor of at most MAX_BYTES over the ranks of `group`."""

    __slots__ = ("_buffer", "_group_name")

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        for op in ("one_shot_all_reduce_copy", "two_shot_all_reduce_"):
            if not hasattr(torch.ops.symm_mem, op):
                raise RuntimeError(f"this torch has no torch.ops.symm_mem.{op}")
        self._group_name = group.group_name
        self._buffer = symm_mem.empty(MAX_BYTES // DTYPE.itemsize, dtype=DTYPE, device=device)
        symm_mem.rendezvous(self._buffer, self._group_name)

    @staticmethod
    def applies(tensor: torch.Tensor) -> bool:
        return (
            tensor.dtype == DTYPE
            and tensor.is_cuda
            and tensor.is_contiguous()
            and tensor.numel() * DTYPE.itemsize <= MAX_BYTES
        )

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks: a new tensor (one-shot) or `tensor` itself (two-shot)."""
        flat = tensor.view(-1)
        staging = self._buffer[: flat.numel()]
        if flat.numel() * DTYPE.itemsize <= ONE_SHOT_MAX_BYTES:
            # Copies the local input into the symmetric buffer inside the kernel.
            out = torch.ops.symm_mem.one_shot_all_reduce_copy(
                staging, flat, "sum", self._group_name
            )
            return out.view(tensor.shape)
        staging.copy_(flat)
        torch.ops.symm_mem.two_shot_all_reduce_(staging, "sum", self._group_name)
        flat.copy_(staging)
        return tensor


def try_symm_mem_all_reduce(
    group: dist.ProcessGroup, device: torch.device
) -> SymmMemAllReduce | None:
    """The symmetric-memory all-reduce of `group`, or None (logged) where the platform lacks
    it; every rank must call this together (the buffer rendezvous is collective)."""
    try:
        all_reduce = SymmMemAllReduce(group, device)
    except Exception as e:  # no P2P access, no symmetric-memory backend, old driver, ...
        logger.warning("symmetric-memory all-reduce unavailable (%s): all-reduce uses NCCL", e)
        return None
    logger.info(
        "all-reduce: symmetric memory up to %d KiB (one-shot up to %d KiB), NCCL above",
        MAX_BYTES // 1024,
        ONE_SHOT_MAX_BYTES // 1024,
    )
    return all_reduce
