"""Constants shared by the structured-output tests."""

from __future__ import annotations

# The shipped tokenizer has 8192 tokens; a model may pad its lm_head past that.
TOKENIZER_VOCAB_SIZE = 8192
MODEL_VOCAB_SIZE = TOKENIZER_VOCAB_SIZE + 70
# The shipped generation config's eos_token_id.
STOP_TOKEN_IDS = (2, 0)
