"""Structured outputs on xgrammar: grammars compiled off the engine loop (cached, with a
deadline), one matcher per request filling its next-token bitmask row on the host (the runner
applies the mask on the device: `model_executor/token_bitmask.py`)."""

from ferrum.structured_output.bitmask_layout import bitmask_width
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
    "bitmask_width",
    "build_tokenizer_info",
]
