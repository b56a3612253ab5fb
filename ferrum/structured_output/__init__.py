"""Structured outputs on xgrammar: grammars compiled off the engine loop (cached, with a
deadline), one matcher per request, and the next-token bitmask filled on the host and applied to
the logits on the device."""

from ferrum.structured_output.bitmask import (
    allocate_token_bitmask,
    allow_all_tokens,
    apply_token_bitmask_,
    apply_token_bitmask_reference,
    bitmask_width,
    forbid_tokens_unless_only_ones,
)
from ferrum.structured_output.compiler import (
    CompiledGrammar,
    GrammarCompilerService,
    GrammarCompileTimeoutError,
    PendingGrammar,
)
from ferrum.structured_output.matcher import (
    BatchBitmaskFiller,
    FilledBitmaskRow,
    StructuredOutputMatcher,
)
from ferrum.structured_output.spec import GrammarKind, GrammarSpec
from ferrum.structured_output.tokenizer_info import build_tokenizer_info

__all__ = [
    "BatchBitmaskFiller",
    "CompiledGrammar",
    "FilledBitmaskRow",
    "GrammarCompileTimeoutError",
    "GrammarCompilerService",
    "GrammarKind",
    "GrammarSpec",
    "PendingGrammar",
    "StructuredOutputMatcher",
    "allocate_token_bitmask",
    "allow_all_tokens",
    "apply_token_bitmask_",
    "apply_token_bitmask_reference",
    "bitmask_width",
    "build_tokenizer_info",
    "forbid_tokens_unless_only_ones",
]
