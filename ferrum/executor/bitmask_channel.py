"""Next-token bitmask rows from the engine core to its workers through shared memory (pickling 256
rows of 19 KB into every pipe took 14.6 ms a step, RESULTS.md): the core writes them into one of
SLOTS round-robin slots of a mapped file and the message names the slot and a sequence number.
A slot is safe to refill SLOTS messages later (the core is at most two launches ahead of rank 0,
collectives keep every rank within three steps); the reader checks the sequence number before and
after copying and raises if overwritten, so a broken bound fails loudly."""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from dataclasses import dataclass

import torch

from ferrum.structured_output import bitmask_width

SLOTS = 4
# Each slot: an int64 sequence number (0 while being written), then the rows, 64-byte aligned.
_HEADER_BYTES = 64


@dataclass(frozen=True, slots=True)
class BitmaskLayout:
    max_rows: int
    vocab_size: int

    @property
    def width(self) -> int:
        return bitmask_width(self.vocab_size)

    @property
    def slot_bytes(self) -> int:
        rows = self.max_rows * self.width * 4
        return _HEADER_BYTES + (rows + 63) // 64 * 64

    @property
    def total_bytes(self) -> int:
        return SLOTS * self.slot_bytes


@dataclass(frozen=True, slots=True)
class BitmaskSlot:
    """Where a message's rows are: `num_rows` rows of slot `slot`, written as `seq`."""

    slot: int
    seq: int
    num_rows: int


class _MappedSlots:
    __slots__ = ("layout", "_map", "_headers", "_rows")

    def __init__(self, fd: int, layout: BitmaskLayout) -> None:
        self.layout = layout
        self._map = mmap.mmap(fd, layout.total_bytes)
        self._headers = []
        self._rows = []
        for slot in range(SLOTS):
            offset = slot * layout.slot_bytes
            header = torch.frombuffer(self._map, dtype=torch.int64, count=1, offset=offset)
            rows = torch.frombuffer(
                self._map,
                dtype=torch.int32,
                count=layout.max_rows * layout.width,
                offset=offset + _HEADER_BYTES,
            ).view(layout.max_rows, layout.width)
            self._headers.append(header)
            self._rows.append(rows)

    def close(self) -> None:
        self._headers.clear()
        self._rows.clear()
        with contextlib.suppress(BufferError):  # a caller still holds rows: the GC unmaps it
            self._map.close()


class BitmaskWriter(_MappedSlots):
    """The core's side: owns the memory file (`fd`, inherited by the workers)."""

    __slots__ = ("fd", "_seq")

    def __init__(self, layout: BitmaskLayout) -> None:
        self.fd = _anonymous_file(layout.total_bytes)
        super().__init__(self.fd, layout)
        self._seq = 0

    def begin(self, num_rows: int) -> tuple[BitmaskSlot, torch.Tensor]:
        """The next slot, marked as being written, and its first `num_rows` rows to fill."""
        if not 0 < num_rows <= self.layout.max_rows:
            raise ValueError(f"num_rows: must be in [1, {self.layout.max_rows}], got {num_rows}")
        self._seq += 1
        slot = BitmaskSlot(self._seq % SLOTS, self._seq, num_rows)
        self._headers[slot.slot].fill_(0)
        return slot, self._rows[slot.slot][:num_rows]

    def publish(self, slot: BitmaskSlot) -> None:
        self._headers[slot.slot].fill_(slot.seq)

    def close(self) -> None:
        super().close()
        os.close(self.fd)


class BitmaskReader(_MappedSlots):
    """A worker's side: maps the core's file through the inherited descriptor."""

    __slots__ = ()

    def read(self, slot: BitmaskSlot) -> torch.Tensor:
        """A copy of the slot's rows; raises if they are not (or no longer) `slot.seq`'s."""
        header = self._headers[slot.slot]
        if int(header.item()) != slot.seq:
            raise RuntimeError(f"bitmask slot {slot.slot} does not hold rows {slot.seq}")
        rows = self._rows[slot.slot][: slot.num_rows].clone()
        if int(header.item()) != slot.seq:
            raise RuntimeError(f"bitmask rows {slot.seq} were overwritten while a worker read them")
        return rows


def _anonymous_file(size: int) -> int:
    """A descriptor of `size` zero bytes of memory with no name (freed with its last fd)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("ferrum-bitmask")
    else:
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    os.ftruncate(fd, size)
    return fd
