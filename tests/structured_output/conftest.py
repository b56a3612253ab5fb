"""The shipped tokenizer as xgrammar sees it, with a model vocabulary padded past it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import xgrammar as xgr
from grammar_fixtures import MODEL_VOCAB_SIZE, STOP_TOKEN_IDS

from ferrum.default_model import DEFAULT_MODEL_DIR
from ferrum.engine.tokenizer import Tokenizer
from ferrum.structured_output import GrammarCompilerService, build_tokenizer_info


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="session")
def tokenizer_info(tokenizer: Tokenizer) -> xgr.TokenizerInfo:
    return build_tokenizer_info(
        tokenizer, vocab_size=MODEL_VOCAB_SIZE, stop_token_ids=STOP_TOKEN_IDS
    )


@pytest.fixture(scope="module")
def compiler(tokenizer_info: xgr.TokenizerInfo) -> Iterator[GrammarCompilerService]:
    service = GrammarCompilerService(tokenizer_info, timeout_s=60.0, max_workers=2)
    yield service
    service.shutdown()
