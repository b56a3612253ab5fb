"""StructuredOutputMatcher: one request's position in its grammar. Invariant: it accepted exactly
the request's output tokens so far (`num_accepted_tokens`); whoever drops output tokens rolls it
back by as many (preemption keeps them, so it leaves it alone). With a token budget (the request's
max_tokens) its mask closes the grammar in time (`closing.BudgetGuard`). Not thread-safe
(xgrammar's GrammarMatcher is not): one owner at a time; distinct ones may run on distinct threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import xgrammar as xgr

from ferrum.structured_output.bitmask_layout import int32_bit
from ferrum.structured_output.closing import BudgetGuard

if TYPE_CHECKING:
    import torch


class StructuredOutputMatcher:
    __slots__ = ("_matcher", "_stop_token_ids", "_budget", "num_accepted_tokens")

    def __init__(self, grammar: xgr.CompiledGrammar, budget: BudgetGuard | None = None) -> None:
        self._matcher = xgr.GrammarMatcher(grammar)
        self._stop_token_ids = tuple(self._matcher.stop_token_ids)
        self._budget = budget
        self.num_accepted_tokens = 0

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advances over `token_ids` in order. Returns False at the first token the grammar
        refuses (a token the mask forbade, or any token after the end); the tokens before it
        stay accepted and the rest are not looked at."""
        for token_id in token_ids:
            if not self._matcher.accept_token(int(token_id)):
                return False
            self.num_accepted_tokens += 1
            if self._budget is not None:
                self._budget.accepted(int(token_id))
        return True

    def rollback(self, num_tokens: int) -> None:
        """Forgets the last `num_tokens` accepted tokens (an end-of-grammar stop token included),
        as if they had never been accepted."""
        if not 0 <= num_tokens <= self.num_accepted_tokens:
            raise ValueError(
                f"num_tokens must be in [0, {self.num_accepted_tokens}] (the tokens accepted), "
                f"got {num_tokens}"
            )
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self.num_accepted_tokens -= num_tokens
            if self._budget is not None:
                self._budget.reset()

    def is_terminated(self) -> bool:
        """True once the grammar ended and its stop token was accepted: the request is done."""
        return self._matcher.is_terminated()

    @property
    def closed_by_budget(self) -> bool:
        """Whether the output was cut short to close the grammar within the token budget."""
        return self._budget is not None and self._budget.truncated

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into row `row` of a host bitmask (`bitmask.py` layout).
        A terminated matcher allows only its stop tokens (the token is dropped anyway: the
        request has finished); one closing its grammar for its budget, only the closing's."""
        forced = self.forced_token()
        if forced is None:
            self._matcher.fill_next_token_bitmask(bitmask, row)
            return
        bitmask[row].zero_()
        for token_id in self._stop_token_ids if forced < 0 else (forced,):
            bitmask[row, token_id // 32] |= int32_bit(token_id % 32)

    def fill_bitmask_after_drafts(
        self, bitmask: torch.Tensor, first_row: int, drafts: Sequence[int]
    ) -> None:
        """Rows first_row + j, j = 0..len(drafts), of a host bitmask: the allowed next tokens
        after the accepted tokens and drafts[:j] (a verify step's rows). The drafts are accepted
        only to look ahead: the matcher ends as it began. A row after a draft the grammar
        refuses repeats the row before, whose mask forbids that draft: it is rejected there, so
        the later rows' draws are never used."""
        budget = None if self._budget is None else self._budget.snapshot()
        looked_ahead = 0
        for j in range(len(drafts) + 1):
            if j > looked_ahead:
                bitmask[first_row + j].copy_(bitmask[first_row + j - 1])
                continue
            self.fill_bitmask(bitmask, first_row + j)
            if j < len(drafts) and self.accept_tokens([drafts[j]]):
                looked_ahead += 1
        if looked_ahead:
            self._matcher.rollback(looked_ahead)
            self.num_accepted_tokens -= looked_ahead
        if self._budget is not None:
            self._budget.restore(budget)

    def forced_token(self) -> int | None:
        """The only token the next mask allows (-1: only the stop tokens), or None."""
        if self._matcher.is_terminated():
            return -1
        if self._budget is None:
            return None
        return self._budget.forced(self._matcher, self.num_accepted_tokens)


class FilledBitmaskRow:
    """A request's next-token bitmask row filled elsewhere, standing in for its matcher: the
    engine core fills the rows from its matchers and sends them with the step to tensor-parallel
    workers, which hold no matcher. `rows` is int32 [n, vocab words] on the host."""

    __slots__ = ("rows", "index")

    def __init__(self, rows: torch.Tensor, index: int) -> None:
        self.rows = rows
        self.index = index

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].copy_(self.rows[self.index])

    def fill_bitmask_after_drafts(
        self, bitmask: torch.Tensor, first_row: int, drafts: Sequence[int]
    ) -> None:
        """The matcher's `fill_bitmask_after_drafts`, filled by the core (`draft_rows.py`):
        its len(drafts) + 1 rows from `index` on."""
        count = len(drafts) + 1
        bitmask[first_row : first_row + count].copy_(self.rows[self.index : self.index + count])


class BatchBitmaskFiller:
    """Fills the bitmask rows of many matchers in one call, on xgrammar's own threads (the GIL
    released): what a decode step of a large constrained batch spends on the host."""

    __slots__ = ("_batch",)

    def __init__(self, max_threads: int | str = "auto") -> None:
        self._batch = xgr.BatchGrammarMatcher(max_threads)

    def fill(
        self,
        bitmask: torch.Tensor,
        rows: Sequence[tuple[int, StructuredOutputMatcher | FilledBitmaskRow]],
    ) -> None:
        """Fills row `i` of the host `bitmask` for each `(i, matcher)`, as
        `matcher.fill_bitmask(bitmask, i)` would."""
        live = []
        for i, matcher in rows:
            if isinstance(matcher, FilledBitmaskRow) or matcher.forced_token() is not None:
                matcher.fill_bitmask(bitmask, i)
            else:
                live.append((i, matcher))
        if len(live) == 1:
            live[0][1].fill_bitmask(bitmask, live[0][0])
        elif live:
            self._batch.batch_fill_next_token_bitmask(
                [m._matcher for _, m in live], bitmask, [i for i, _ in live]
            )

    def fill_with_drafts(
        self,
        bitmask: torch.Tensor,
        rows: Sequence[tuple[int, StructuredOutputMatcher | FilledBitmaskRow, Sequence[int]]],
    ) -> None:
        """For each `(first_row, matcher, drafts)`: its rows after each draft (one row without
        drafts, filled in one batch)."""
        self.fill(bitmask, [(row, matcher) for row, matcher, drafts in rows if not drafts])
        for row, matcher, drafts in rows:
            if drafts:
                matcher.fill_bitmask_after_drafts(bitmask, row, drafts)
