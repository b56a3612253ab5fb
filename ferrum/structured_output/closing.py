"""Closings: the text that completes a grammar from a matcher's state, as tokens, so that a request
near the end of its token budget can be steered to a complete output rather than cut off. Found
greedily on a fork of the matcher: the grammar's forced text when there is some, else the first
candidate it accepts: the closing tags of XML values, closing punctuation, a structural tag's end
strings (they leave free text), printable ASCII, UTF-8 continuation bytes (after a token that
split a character). A candidate chosen `_MAX_REPEATS` times in a row goes behind the others, so a
loop (a quote in free text) moves on. Short, not always the shortest; None if none is found."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import xgrammar as xgr

_PUNCTUATION = (b'"', b"}", b"]", b"0")
_ASCII = tuple(bytes([b]) for b in range(0x21, 0x7F) if bytes([b]) not in _PUNCTUATION)
_CONTINUATION = tuple(bytes([b]) for b in range(0x80, 0xC0))
_MAX_REPEATS = 2
# Vocabulary pieces longer than this are not used to spell a closing.
_MAX_PIECE_BYTES = 16
# A closing is forced once the tokens left are at most its length plus this (or a quarter of the
# tokens left, if less): one token can lengthen the closing (`{` of an object with required keys).
_MARGIN = 16
_MAX_CLOSING_BYTES = 1024
# Tokens after which a closing not found is looked for again, doubling after each miss (a grammar
# the greedy search cannot close costs its search once in a while, not every few tokens).
_RETRY_AFTER = 8
_MAX_RETRY_AFTER = 512
# Candidates tried in one search (each an xgrammar accept on a fork): bounds its host time.
_MAX_ATTEMPTS = 20_000


class ClosingVocab:
    """Spells bytes as token ids: longest vocabulary piece first (special tokens never)."""

    __slots__ = ("_ids", "_max_len")

    def __init__(self, info: xgr.TokenizerInfo) -> None:
        special = set(info.special_token_ids) | set(info.stop_token_ids)
        ids: dict[bytes, int] = {}
        for token_id, piece in enumerate(info.decoded_vocab):
            if piece and token_id not in special and len(piece) <= _MAX_PIECE_BYTES:
                ids.setdefault(bytes(piece), token_id)
        self._ids = ids
        self._max_len = max(map(len, ids), default=1)

    def encode(self, text: bytes) -> list[int] | None:
        """Token ids spelling `text`, or None if some byte has no token."""
        token_ids = []
        at = 0
        while at < len(text):
            for size in range(min(self._max_len, len(text) - at), 0, -1):
                token_id = self._ids.get(text[at : at + size])
                if token_id is not None:
                    token_ids.append(token_id)
                    at += size
                    break
            else:
                return None
        return token_ids


class Closer:
    """Finds closings for the matchers of one compiled grammar."""

    __slots__ = ("_vocab", "_orders", "_free_orders")

    def __init__(
        self, vocab: ClosingVocab, closing_tags: Iterable[str] = (), ends: Iterable[str] = ()
    ) -> None:
        """`closing_tags` end XML values (tried first: strings exclude them); `ends` leave free
        text (tried after the punctuation: a JSON string may hold them)."""
        self._vocab = vocab
        tags = dict.fromkeys(t.encode() for t in closing_tags if t)
        first = (*tags, *_PUNCTUATION, *dict.fromkeys(e.encode() for e in ends if e))
        # A second order for grammars the first loops in: `(ab)+c` ends with the later letter.
        self._orders = (
            (*first, *_ASCII, *_CONTINUATION),
            (*first, *reversed(_ASCII), *_CONTINUATION),
        )
        # In free text (reasoning before a tag), its way out first, not punctuation.
        out = (*dict.fromkeys(e.encode() for e in ends if e), *tags, *_PUNCTUATION)
        self._free_orders = ((*out, *_ASCII, *_CONTINUATION),) + self._orders

    def closing(self, matcher: xgr.GrammarMatcher, max_bytes: int) -> list[int] | None:
        """The tokens that complete the grammar from `matcher`'s state ([] if it is complete),
        checked on a fork (the matcher is untouched); None if none is found in `max_bytes`."""
        if matcher.is_completed():
            return []
        orders = self._free_orders if self.free_text(matcher) else self._orders
        attempts = [_MAX_ATTEMPTS]
        for order in orders:
            text = _closing_text(matcher.fork(), order, max_bytes, attempts)
            token_ids = None if text is None else self._vocab.encode(text)
            if token_ids is None:
                continue
            check = matcher.fork()
            if all(check.accept_token(t) for t in token_ids) and check.is_completed():
                return token_ids
        return None

    def free_text(self, matcher: xgr.GrammarMatcher) -> bool:
        """Whether the grammar takes a letter next (free text, where any length is complete)."""
        return matcher.fork().accept_string(b"a")


def _closing_text(
    fork: xgr.GrammarMatcher, candidates: tuple[bytes, ...], max_bytes: int, attempts: list[int]
) -> bytes | None:
    """Greedy: the forced text, else the first candidate accepted; a candidate chosen
    `_MAX_REPEATS` times in a row without forced text between goes last. `attempts[0]`: the
    candidates left to try in this search (shared by its orders); None once spent."""
    pieces: list[bytes] = []
    size = 0
    order = list(candidates)
    last, repeats = b"", 0
    while not fork.is_completed():
        if size >= max_bytes:
            return None
        forced = fork.find_jump_forward_string().encode()
        if forced and fork.accept_string(forced):
            piece = forced
            order, last, repeats = list(candidates), b"", 0
        else:
            piece = b""
            for candidate in order:
                attempts[0] -= 1
                if attempts[0] < 0:
                    return None
                if fork.accept_string(candidate):
                    piece = candidate
                    break
            if not piece:
                return None
            repeats = repeats + 1 if piece == last else 1
            last = piece
            if repeats == _MAX_REPEATS:
                order.remove(piece)
                order.append(piece)
        pieces.append(piece)
        size += len(piece)
    return b"".join(pieces)


def tag_exits(structural_tag: Any) -> tuple[list[str], list[str]]:
    """The ways out of a structural tag's XML values and free text: the closing tags (`</...`)
    it excludes, and its tags' `end` strings."""
    closing_tags: list[str] = []
    ends: list[str] = []
    if isinstance(structural_tag, list):
        for item in structural_tag:
            more_tags, more_ends = tag_exits(item)
            closing_tags += more_tags
            ends += more_ends
    elif isinstance(structural_tag, dict):
        end = structural_tag.get("end") if structural_tag.get("type") == "tag" else None
        ends += [end] if isinstance(end, str) else [e for e in end or () if isinstance(e, str)]
        excludes = structural_tag.get("excludes")
        if isinstance(excludes, list):
            closing_tags += [e for e in excludes if isinstance(e, str) and e.startswith("</")]
        more_tags, more_ends = tag_exits(list(structural_tag.values()))
        closing_tags += more_tags
        ends += more_ends
    return closing_tags, ends


class BudgetGuard:
    """One request's token budget against its grammar. The closing is measured at intervals that
    shrink with the slack (tokens left less the closing); once the slack is within a margin, the
    closing's tokens are the only ones allowed, then the stop tokens. A complete output with no
    room left for another closing as long as the longest seen (a second tool call) stops there,
    unless the grammar goes on in free text (text may end anywhere)."""

    __slots__ = (
        "_closer",
        "_max_tokens",
        "_plan",
        "_next_check",
        "_longest",
        "_ending",
        "_retry_after",
        "truncated",
    )

    def __init__(self, closer: Closer, max_tokens: int) -> None:
        self._closer = closer
        self._max_tokens = max_tokens
        self._plan: list[int] = []  # the closing being forced, next token first
        self._ending = False  # the plan ends the output: then only stop tokens
        self._next_check = 0  # the number of accepted tokens at which to measure again
        self._longest = 0  # the longest closing measured
        self._retry_after = _RETRY_AFTER
        # The output was cut short to close in time (a "length" finish, however valid).
        self.truncated = False

    def forced(self, matcher: xgr.GrammarMatcher, num_accepted: int) -> int | None:
        """The only token allowed next (-1: only the stop tokens), or None: the grammar's mask."""
        if self._plan:
            return self._plan[0]
        if self._ending:
            return -1
        if num_accepted < self._next_check:
            return None
        left = self._max_tokens - num_accepted
        margin = min(_MARGIN, left // 4)
        closing = self._closer.closing(matcher, min(_MAX_CLOSING_BYTES, 8 * left + 64))
        if closing is None:
            self._next_check = num_accepted + self._retry_after
            self._retry_after = min(2 * self._retry_after, _MAX_RETRY_AFTER)
            return None
        self._retry_after = _RETRY_AFTER
        self._longest = max(self._longest, len(closing))
        if closing:
            slack = left - len(closing) - 1 - margin  # 1: the stop token after it
        else:
            slack = left - self._longest - 1 - margin
            if slack <= 0 and self._closer.free_text(matcher):
                slack = 1  # text goes on, checked again next step
        if slack > 0:  # measured again by the time the closing could be done
            self._next_check = num_accepted + max(1, min(slack // 4, len(closing)))
            return None
        self._plan, self._ending = closing, True
        self.truncated = bool(closing)
        return self._plan[0] if self._plan else -1

    def accepted(self, token_id: int) -> None:
        if self._plan and self._plan[0] == token_id:
            self._plan.pop(0)
        elif self._plan:  # not the closing's token: measure again
            self.reset()

    def reset(self) -> None:
        self._plan, self._ending, self._next_check = [], False, 0
        self.truncated = False

    def snapshot(self) -> tuple:
        """The guard's state, for `restore` after tokens accepted only to look ahead."""
        return (list(self._plan), self._ending, self._next_check, self._longest,
                self._retry_after, self.truncated)  # fmt: skip

    def restore(self, state: tuple) -> None:
        plan, self._ending, self._next_check, self._longest, self._retry_after, self.truncated = (
            state
        )
        self._plan = list(plan)
