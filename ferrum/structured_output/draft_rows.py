"""A verify step's bitmask rows: a constrained request verifying drafts d_1..d_k has k + 1 rows
(its mask after its tokens, then after each draft), laid out request after request in the order
given. The engine core fills them for a multi-process executor's ranks and each rank finds a
request's first row the same way."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def draft_row_starts(
    req_ids: Sequence[str], drafts: Mapping[str, Sequence[int]]
) -> tuple[list[int], int]:
    """Each request's first row, and the rows in all."""
    starts, total = [], 0
    for req_id in req_ids:
        starts.append(total)
        total += 1 + len(drafts.get(req_id, ()))
    return starts, total
