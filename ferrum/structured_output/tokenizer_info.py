"""xgrammar's view of a model's vocabulary, from ferrum's Tokenizer. It has the MODEL's vocab size
(the logits' width): undefined ids (padded lm_head rows) and special tokens are empty entries,
never allowed; stop tokens are allowed only where the grammar may end, and end it. Regular tokens
are in the tokenizer's own encoding (xgrammar decodes them); added non-special tokens are text.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from typing import Protocol

import tokenizers
import xgrammar as xgr


class TokenizerLike(Protocol):
    """What is needed from `ferrum.engine.tokenizer.Tokenizer`."""

    backend: tokenizers.Tokenizer
    all_special_ids: set[int]


def build_tokenizer_info(
    tokenizer: TokenizerLike, *, vocab_size: int, stop_token_ids: Iterable[int]
) -> xgr.TokenizerInfo:
    """`vocab_size` is the model's (lm_head rows), which may differ from the tokenizer's;
    `stop_token_ids` are the model's end-of-sequence ids (e.g. the generation config's)."""
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be an integer >= 1, got {vocab_size!r}")
    stop_ids = sorted(set(stop_token_ids))
    if not stop_ids:
        raise ValueError("stop_token_ids must name at least one token: a grammar ends on one")
    if not all(isinstance(i, int) and 0 <= i < vocab_size for i in stop_ids):
        raise ValueError(f"stop_token_ids must be ids in [0, {vocab_size}), got {stop_ids}")

    backend = tokenizer.backend
    # xgrammar's own detection from tokenizer.json (what its Hugging Face loader uses).
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    vocab_type: xgr.VocabType = metadata["vocab_type"]
    added = backend.get_added_tokens_decoder()
    special_ids = set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}

    encoded_vocab = [""] * vocab_size
    for token, token_id in backend.get_vocab(with_added_tokens=True).items():
        if token_id >= vocab_size or token_id in special_ids:
            continue
        if token_id in added and vocab_type is xgr.VocabType.BYTE_LEVEL:
            # Added tokens hold plain text, not the byte-level alphabet the rest is spelt in.
            token = "".join(_byte_level_alphabet()[b] for b in token.encode("utf-8"))
        encoded_vocab[token_id] = token
    return xgr.TokenizerInfo(
        encoded_vocab,
        vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stop_ids,
        add_prefix_space=bool(metadata["add_prefix_space"]),
    )


@cache
def _byte_level_alphabet() -> tuple[str, ...]:
    """Byte -> character of GPT-2's byte-level BPE: printable Latin-1 bytes stand for
    themselves, the other 68 bytes for chr(256 + k) in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet: dict[int, str] = {b: chr(b) for b in printable}
    shifted = [b for b in range(256) if b not in alphabet]
    for k, b in enumerate(shifted):
        alphabet[b] = chr(256 + k)
    return tuple(alphabet[b] for b in range(256))
