"""Token embedding and the LM head (optionally tied), whole or split over a tensor-parallel group
by vocabulary rows: padded to a multiple of tp, rank r holds rows [r * n, (r + 1) * n) (padding
zero, never loaded). The embedding looks up its range and all-reduces; the LM head all-gathers its
logit columns, so every rank holds the same full logits.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import nn

from ferrum.distributed.parallel_state import TensorParallelGroup
from ferrum.kernels.interface import Kernels
from ferrum.model_executor.layers.linear import check_shape, new_parameter, set_weight_loader
from ferrum.model_executor.weight_loader import CheckpointTensor, materialize


def padded_vocab_size(vocab_size: int, world_size: int) -> int:
    return -(-vocab_size // world_size) * world_size


class VocabEmbedding(nn.Module):
    def __init__(
        self, vocab_size: int, hidden_size: int, tp_group: TensorParallelGroup | None = None
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_group = tp_group or TensorParallelGroup()
        tp = self.tp_group.world_size
        self.num_local_rows = padded_vocab_size(vocab_size, tp) // tp
        self.vocab_start = self.tp_group.rank * self.num_local_rows
        # Rows of the checkpoint this rank holds (the last ranks' may be padding only).
        self.num_loaded_rows = max(0, min(self.num_local_rows, vocab_size - self.vocab_start))
        self.weight = new_parameter(self.num_local_rows, hidden_size)
        if tp > 1:
            set_weight_loader(self.weight, self._load_rank_rows)
            self.weight.reads_slices = True  # type: ignore[attr-defined]

    def _load_rank_rows(
        self, param: nn.Parameter, loaded: torch.Tensor | CheckpointTensor, shard_id: Hashable
    ) -> set[Hashable]:
        if shard_id is not None:
            raise ValueError(f"parameter takes no shard, got shard {shard_id!r}")
        check_shape(torch.Size((self.vocab_size, param.shape[1])), loaded.shape)
        rows = materialize(loaded.narrow(0, self.vocab_start, self.num_loaded_rows))
        param.data[: self.num_loaded_rows].copy_(rows)
        param.data[self.num_loaded_rows :].zero_()
        return {None}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [num_tokens] -> [num_tokens, hidden_size]."""
        if self.tp_group.world_size == 1:
            return torch.nn.functional.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.num_local_rows)
        embedded = torch.nn.functional.embedding(local_ids.masked_fill(outside, 0), self.weight)
        embedded.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp_group.all_reduce(embedded)


class LMHead(nn.Module):
    """logits = hidden @ W^T with W: [vocab_size, hidden_size]; tied heads share the embedding's
    Parameter object (split the same way), so the checkpoint's (absent or duplicate) lm_head
    tensor is not needed. The product is `kernels.dense_linear` (Triton: the one-row GEMV, or
    the few-row kernel where a tuned table lists the shape)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        kernels: Kernels,
        tied_to: VocabEmbedding | None = None,
        tp_group: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self._linear = kernels.dense_linear
        self.tp_group = tp_group or TensorParallelGroup()
        if tied_to is None:
            # Holds and loads its rows exactly as an embedding of the same vocabulary would.
            rows = VocabEmbedding(vocab_size, hidden_size, self.tp_group)
            self.weight = rows.weight
        else:
            self.weight = tied_to.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] float32, the same on every rank."""
        logits = self._linear(hidden_states, self.weight).float()
        if self.tp_group.world_size == 1:
            return logits
        logits = self.tp_group.all_gather(logits, dim=-1)
        if logits.shape[-1] == self.vocab_size:
            return logits
        return logits[:, : self.vocab_size].contiguous()
