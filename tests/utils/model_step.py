"""Drives a model through the runner contract by hand, without scheduler or runner.

A step is a flat token batch over a paged KV cache: each `Seq` brings its whole context, its block
ids and how many of its last tokens are this step's query. Blocks hold BLOCK_SIZE tokens; the
cache has NUM_BLOCKS blocks per layer and block 0 is free for padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrum.config import ModelConfig
from ferrum.model_executor.attention_metadata import AttentionMetadata
from ferrum.model_executor.model_loader import load_model

BLOCK_SIZE = 4
NUM_BLOCKS = 24
CPU = torch.device("cpu")


@dataclass
class Seq:
    """One request in a step: its whole context so far, its KV blocks, and how many of the last
    context tokens are this step's query."""

    token_ids: list[int]
    block_ids: list[int]
    num_new: int


def build_step(seqs: list[Seq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    for seq in seqs:
        seq_len = len(seq.token_ids)
        for pos in range(seq_len - seq.num_new, seq_len):
            input_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(seq.block_ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        query_start_loc.append(len(input_ids))
    max_blocks = max(len(seq.block_ids) for seq in seqs)
    block_tables = [seq.block_ids + [0] * (max_blocks - len(seq.block_ids)) for seq in seqs]
    seq_lens = [len(seq.token_ids) for seq in seqs]
    metadata = AttentionMetadata(
        num_reqs=len(seqs),
        num_tokens=len(input_ids),
        max_query_len=max(seq.num_new for seq in seqs),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=(torch.tensor(block_tables, dtype=torch.int32),),
        slot_mapping=(torch.tensor(slots, dtype=torch.int64),),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    return torch.tensor(input_ids), torch.tensor(positions), metadata


def new_kv_caches(model_config: ModelConfig) -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, model_config.num_kv_heads, model_config.head_dim)
    return [torch.zeros(shape) for _ in range(model_config.num_hidden_layers)]


def load(path: str, **kwargs: object) -> tuple[ModelConfig, torch.nn.Module]:
    config = ModelConfig(path, **kwargs)
    model = load_model(config, CPU)
    model.bind_kv_caches(new_kv_caches(config))
    return config, model


@torch.inference_mode()
def run_step(model: torch.nn.Module, seqs: list[Seq]) -> list[torch.Tensor]:
    """Logits of each request's query tokens: [num_new, vocab] per request."""
    input_ids, positions, metadata = build_step(seqs)
    logits = model.compute_logits(model(input_ids, positions, metadata))
    assert logits.dtype == torch.float32
    return list(logits.split([seq.num_new for seq in seqs]))


def prompt(length: int, offset: int) -> list[int]:
    return [(offset + 37 * i) % 384 for i in range(length)]
