import pytest
import torch

from ferrum.executor.bitmask_channel import (
    SLOTS,
    BitmaskLayout,
    BitmaskReader,
    BitmaskWriter,
)

LAYOUT = BitmaskLayout(max_rows=8, vocab_size=100)


@pytest.fixture
def channel():
    writer = BitmaskWriter(LAYOUT)
    reader = BitmaskReader(writer.fd, LAYOUT)
    yield writer, reader
    reader.close()
    writer.close()


def _write(writer: BitmaskWriter, values: torch.Tensor):
    slot, rows = writer.begin(values.shape[0])
    rows.copy_(values)
    writer.publish(slot)
    return slot


def test_reader_gets_a_copy_of_each_published_slot(channel) -> None:
    writer, reader = channel
    slots = []
    for k in range(SLOTS):
        values = torch.randint(-(2**31), 2**31 - 1, (k + 1, LAYOUT.width), dtype=torch.int32)
        slots.append((_write(writer, values), values))
    for slot, values in slots:
        rows = reader.read(slot)
        assert torch.equal(rows, values)
    # A copy: refilling the slot later does not change rows already read.
    first_slot, first_values = slots[0]
    first_rows = reader.read(first_slot)
    _write(writer, torch.zeros(1, LAYOUT.width, dtype=torch.int32))
    assert torch.equal(first_rows, first_values)


def test_overwritten_or_unpublished_rows_raise(channel) -> None:
    writer, reader = channel
    old = _write(writer, torch.ones(2, LAYOUT.width, dtype=torch.int32))
    for _ in range(SLOTS):
        _write(writer, torch.zeros(2, LAYOUT.width, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=f"does not hold rows {old.seq}"):
        reader.read(old)
    pending, _ = writer.begin(1)
    with pytest.raises(RuntimeError, match=f"does not hold rows {pending.seq}"):
        reader.read(pending)


def test_row_count_is_checked(channel) -> None:
    writer, _ = channel
    with pytest.raises(ValueError, match=r"num_rows: must be in \[1, 8\], got 9"):
        writer.begin(9)
