"""Per-device arrival counters for kernels whose programs share an output tile: each program
counts its arrival on the tile's counter; the last to arrive sums the others' partials and resets
the counter to zero. Used by the split-K FP8 GEMM, the few-row linear's split-K, the fused MoE's
split down GEMV, the LoRA shrink and split-KV attention's fused combine; all such launches on a
device share one buffer, so they must run one at a time (one stream: the forward)."""

from __future__ import annotations

import torch

_counters: dict[torch.device, torch.Tensor] = {}
# Outgrown buffers stay allocated: a CUDA graph captured before the growth still points at them.
_outgrown: list[torch.Tensor] = []


def arrival_counters(device: torch.device, num_tiles: int, user: str) -> torch.Tensor:
    """The arrival counters of this device, at least num_tiles of them, all zero between
    launches. They are sized outside CUDA graph capture (the engine's warm-up runs every batch
    bucket first): a buffer made during capture would be zeroed only by the graph's replays, so
    growing one then raises, naming `user` (the kernel that asked)."""
    counters = _counters.get(device)
    if counters is None or counters.numel() < num_tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{user}: {num_tiles} arrival counters are needed during CUDA graph capture but "
                "were not allocated before it; run this shape once first"
            )
        if counters is not None:
            _outgrown.append(counters)
        size = max(num_tiles, 1 << 14, 0 if counters is None else 2 * counters.numel())
        counters = _counters[device] = torch.zeros(size, dtype=torch.int32, device=device)
    return counters
