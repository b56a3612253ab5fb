"""One rank's view of the pipeline: its stage, its peers, and the broadcast of the last stage's
sampled tokens. Global rank r is tensor-parallel rank r % tp of stage r // tp and talks to the
same tp index in the neighbouring stages. Calls run on the caller's CUDA stream with NCCL (the
host never waits); they match because every rank runs the same steps in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class PipelineGroup:
    """Stage `rank` of `size`; a group of one stage needs no torch.distributed."""

    __slots__ = ("rank", "size", "is_token_root", "_prev", "_next", "_token_root")

    def __init__(self, rank: int = 0, size: int = 1, tp_rank: int = 0, tp_size: int = 1) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank: must be in [0, pipeline_parallel_size={size}), got {rank}")
        self.rank = rank
        self.size = size
        me = rank * tp_size + tp_rank
        self._prev = me - tp_size
        self._next = me + tp_size
        # The last stage's first tensor-parallel rank: every rank of that stage samples the same.
        self._token_root = (size - 1) * tp_size
        self.is_token_root = me == self._token_root

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def send_to_next(self, tensor: torch.Tensor) -> None:
        assert not self.is_last
        dist.send(tensor.contiguous(), dst=self._next)

    def recv_from_prev(self, tensor: torch.Tensor) -> torch.Tensor:
        """Fills `tensor` (its shape agreed with the sender) in place; returns it."""
        assert not self.is_first
        dist.recv(tensor, src=self._prev)
        return tensor

    def broadcast_tokens(self, tokens: torch.Tensor) -> dist.Work | None:
        """Starts sending the last stage's `tokens` into every rank's `tokens` (same shape);
        the returned handle's `wait()` makes them safe to read (on CUDA: on the current
        stream). None with one stage."""
        if self.size == 1:
            return None
        return dist.broadcast(tokens, src=self._token_root, async_op=True)
