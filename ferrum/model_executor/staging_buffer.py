"""A device buffer filled from host staging memory by one host->device copy per step: a step lays
its arrays out from offset 0 (`take`), fills their host views and `copy`s the taken bytes at once.
Arrays start on 64-byte boundaries (Triton compiles for its pointers' alignment, so it must not
change between steps). The host may run ahead of the device, so host memory alternates between two
sets (pinned on CUDA), each rewritten only once the event after its last copy has fired."""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 64
_NUMPY_DTYPES = {
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.float32: np.float32,
    torch.bool: np.bool_,
}


def staging_bytes(*arrays: tuple[int, torch.dtype]) -> int:
    """Bytes a step needs for arrays of these (length, dtype), alignment included."""
    return sum(-(-n * dtype.itemsize // _ALIGN) * _ALIGN for n, dtype in arrays)


class StagingBuffer:
    def __init__(self, num_bytes: int, device: torch.device) -> None:
        self.device = device
        self.num_bytes = num_bytes
        cuda = device.type == "cuda"
        self._host_bytes = [
            torch.zeros(num_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)
        ]
        self._host_np = [h.numpy() for h in self._host_bytes]
        # Off CUDA the host sets are the device memory (the copy is a no-op).
        self._device_bytes = (
            torch.zeros(num_bytes, dtype=torch.uint8, device=device) if cuda else None
        )
        # Recorded after each set's last copy (CUDA only).
        self._copied = [torch.cuda.Event(), torch.cuda.Event()] if cuda else None
        self._set = 0
        self._used = 0

    def begin(self) -> None:
        """Starts a step's layout in the other host set, once that set's last copy is done."""
        self._set ^= 1
        if self._copied is not None:
            self._copied[self._set].synchronize()  # a no-op before its first record
        self._used = 0

    def take(self, n: int, dtype: torch.dtype) -> tuple[np.ndarray, torch.Tensor]:
        """The step's next n-element array: its host view (write it before `copy`) and its device
        view (holds those values once `copy` is queued)."""
        start = self._used
        end = start + n * dtype.itemsize
        if end > self.num_bytes:
            raise ValueError(
                f"step inputs need more than the {self.num_bytes}-byte staging buffer sized "
                "from max_num_seqs, max_num_batched_tokens and max_model_len at start-up"
            )
        self._used = -(-end // _ALIGN) * _ALIGN
        host = self._host_np[self._set][start:end].view(_NUMPY_DTYPES[dtype])
        device = self._host_bytes[self._set] if self._device_bytes is None else self._device_bytes
        return host, device[start:end].view(dtype)

    def copy(self) -> None:
        """Queues one copy of everything taken since `begin` to the device; never waits."""
        used = min(self._used, self.num_bytes)
        if self._device_bytes is None or used == 0:
            return
        self._device_bytes[:used].copy_(self._host_bytes[self._set][:used], non_blocking=True)
        self._copied[self._set].record()
