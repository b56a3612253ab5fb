"""Rank functions for tests/model_executor/test_parallel_layers.py (module level: picklable).

Each builds a layer whole (a group of one) and split over the pool's group from the same full
weights, loads both through the parameters' weight loaders, runs both on the same input and
returns what the test compares: this rank's output and the slice of the whole output it must
equal (or the whole output, for layers that all-reduce or all-gather).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import nn

from ferrum.distributed.parallel_state import TensorParallelGroup
from ferrum.kernels.interface import torch_kernels
from ferrum.model_executor.layers.embed_head import LMHead, VocabEmbedding
from ferrum.model_executor.layers.fused_moe import DOWN, GATE, GATE_UP, UP, FusedMoE
from ferrum.model_executor.layers.parallel_linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from ferrum.model_executor.model_loader import load_model
from ferrum.model_executor.weight_loader import CheckpointTensor

HIDDEN, HEAD_DIM, NUM_HEADS, NUM_TOKENS = 12, 4, 4, 5
Pair = tuple[torch.Tensor, torch.Tensor]


def _load(module: nn.Module, tensors: dict[str, tuple[torch.Tensor, Hashable]]) -> None:
    """Feeds each (parameter name -> (full tensor, shard id)) to the parameter's loader."""
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, (tensor, shard_id) in tensors.items():
            param = params[name.split("#")[0]]
            param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]


def _both(
    group: TensorParallelGroup,
    build: Callable[[TensorParallelGroup | None], nn.Module],
    tensors: dict[str, tuple[torch.Tensor, Hashable]],
    run: Callable[[nn.Module], torch.Tensor],
) -> Pair:
    """(split layer's output on this rank, whole layer's output)."""
    split, whole = build(group), build(None)
    _load(split, tensors)
    _load(whole, tensors)
    with torch.no_grad():
        return run(split), run(whole)


def linear_layers(group: TensorParallelGroup) -> dict[str, Pair]:
    """Each pair: (this rank's output, the part of the whole layer's output it must equal)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_TOKENS, HIDDEN, generator=gen)
    rank, tp = group.rank, group.world_size
    out: dict[str, Pair] = {}

    gate, up = torch.randn(6, HIDDEN, generator=gen), torch.randn(6, HIDDEN, generator=gen)
    mine, whole = _both(
        group,
        lambda g: MergedColumnParallelLinear(HIDDEN, {"gate": 6, "up": 6}, False, g),
        {"weight": (gate, "gate"), "weight#up": (up, "up")},
        lambda m: m(x),
    )
    g_whole, u_whole = whole.split(6, dim=1)
    out["merged_column"] = (
        mine,
        torch.cat([g_whole.chunk(tp, 1)[rank], u_whole.chunk(tp, 1)[rank]], 1),
    )

    for num_kv in (2, 1):  # KV heads split, then one KV head replicated on both ranks
        q = torch.randn(NUM_HEADS * HEAD_DIM, HIDDEN, generator=gen)
        k, v = (torch.randn(num_kv * HEAD_DIM, HIDDEN, generator=gen) for _ in range(2))
        bias = [torch.randn(t.shape[0], generator=gen) for t in (q, k, v)]
        tensors = {
            "weight": (q, "q"),
            "weight#k": (k, "k"),
            "weight#v": (v, "v"),
            "bias": (bias[0], "q"),
            "bias#k": (bias[1], "k"),
            "bias#v": (bias[2], "v"),
        }
        mine, whole = _both(
            group,
            lambda g, kv=num_kv: QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, kv, True, g),
            tensors,
            lambda m: m(x),
        )
        q_whole, k_whole, v_whole = whole.split([q.shape[0], k.shape[0], k.shape[0]], dim=1)
        kv_heads = max(1, num_kv // tp)
        first_kv = rank * num_kv // tp if num_kv < tp else rank * kv_heads
        kv_cols = slice(first_kv * HEAD_DIM, (first_kv + kv_heads) * HEAD_DIM)
        expected = torch.cat(
            [q_whole.chunk(tp, 1)[rank], k_whole[:, kv_cols], v_whole[:, kv_cols]], dim=1
        )
        out[f"qkv_{num_kv}_kv_heads"] = (mine, expected)

    w, b = torch.randn(HIDDEN, 8, generator=gen), torch.randn(HIDDEN, generator=gen)
    x8 = torch.randn(NUM_TOKENS, 8, generator=gen)
    split, whole = RowParallelLinear(8, HIDDEN, True, group), RowParallelLinear(8, HIDDEN, True)
    for layer in (split, whole):
        _load(layer, {"weight": (w, None), "bias": (b, None)})
    with torch.no_grad():
        out["row"] = (split(x8.chunk(tp, dim=1)[rank]), whole(x8))

    vocab = 11  # odd: padded to 12 over two ranks
    table = torch.randn(vocab, HIDDEN, generator=gen)
    ids = torch.tensor([0, 10, 5, 6, 3, 10])
    out["embedding"] = _both(
        group,
        lambda g: VocabEmbedding(vocab, HIDDEN, g),
        {"weight": (table, None)},
        lambda m: m(ids),
    )
    out["lm_head"] = _both(
        group,
        lambda g: LMHead(vocab, HIDDEN, torch_kernels(), None, g),
        {"weight": (table, None)},
        lambda m: m(x),
    )
    return out


def moe_layers(group: TensorParallelGroup) -> dict[str, Pair]:
    """FusedMoE (torch reference) split by intermediate rows and by experts, loaded from
    per-expert and from stacked tensors: (this rank's all-reduced output, the whole layer's)."""
    gen = torch.Generator().manual_seed(1)
    num_experts, top_k, inter = 4, 2, 6
    x = torch.randn(NUM_TOKENS, HIDDEN, generator=gen)
    logits = torch.randn(NUM_TOKENS, num_experts, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, HIDDEN, generator=gen)
    w2 = torch.randn(num_experts, HIDDEN, inter, generator=gen)
    per_expert: dict[str, tuple[torch.Tensor, Hashable]] = {}
    for e in range(num_experts):
        per_expert[f"w13#g{e}"] = (w13[e, :inter], (GATE, e))
        per_expert[f"w13#u{e}"] = (w13[e, inter:], (UP, e))
        per_expert[f"w2#{e}"] = (w2[e], (DOWN, e))
    stacked = {"w13": (w13, (GATE_UP, None)), "w2": (w2, (DOWN, None))}
    out: dict[str, Pair] = {}
    for ep in (False, True):
        for layout, tensors in (("per_expert", per_expert), ("stacked", stacked)):
            out[f"ep={ep},{layout}"] = _both(
                group,
                lambda g, ep=ep: FusedMoE(
                    num_experts, top_k, HIDDEN, inter, True, "silu", torch_kernels(), g, ep
                ),
                tensors,
                lambda m: m(x, logits),
            )
    return out


def checkpoint_reads(
    group: TensorParallelGroup, model_config: object, expert_parallel: bool
) -> list[tuple[str, tuple[int, ...], int]]:
    """Loads this rank's shard of a checkpoint; returns every read: (tensor name, shape read,
    elements of the whole tensor)."""
    reads: list[tuple[str, tuple[int, ...], int]] = []
    original = CheckpointTensor.load

    def recording_load(self: CheckpointTensor) -> torch.Tensor:
        tensor = original(self)
        reads.append((self.name, tuple(tensor.shape), self._full_shape.numel()))
        return tensor

    CheckpointTensor.load = recording_load  # type: ignore[method-assign]
    try:
        load_model(model_config, torch.device("cpu"), "torch", group, expert_parallel)  # type: ignore[arg-type]
    finally:
        CheckpointTensor.load = original  # type: ignore[method-assign]
    return reads
