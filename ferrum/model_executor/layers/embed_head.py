"""Token embedding and the LM head (optionally tied to the embedding)."""

from __future__ import annotations

import torch
from torch import nn

from ferrum.model_executor.layers.linear import new_parameter


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = new_parameter(vocab_size, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [num_tokens] -> [num_tokens, hidden_size]."""
        return torch.nn.functional.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """logits = hidden @ W^T with W: [vocab_size, hidden_size]; tied heads share the embedding's
    Parameter object, so the checkpoint's (absent or duplicate) lm_head tensor is not needed."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = new_parameter(vocab_size, hidden_size) if tied_to is None else tied_to.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] float32."""
        return torch.nn.functional.linear(hidden_states, self.weight).float()
