"""Which decoder layers a pipeline stage holds: stage s of P holds [start_layer, end_layer) of an
even split (earlier stages take one more where it does not divide); the first also holds the
embedding, the last the final norm and LM head. Layer indices stay global, so checkpoint names and
KV cache groups mean the same on every stage. A stage's forward maps `(hidden, residual)` in to out.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

# What a stage hands the next one: the hidden states and the residual stream, [tokens, hidden].
StageActivations = tuple[torch.Tensor, torch.Tensor]

_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class PipelineStage:
    rank: int
    size: int
    start_layer: int
    end_layer: int

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def layer_ids(self) -> range:
        return range(self.start_layer, self.end_layer)

    def holds_parameter(self, name: str) -> bool:
        """Whether a model parameter (or checkpoint tensor) name belongs to this stage."""
        match = _LAYER_NAME.search(name)
        if match:
            return self.start_layer <= int(match.group(1)) < self.end_layer
        if "embed_tokens." in name:
            return self.is_first
        if name.startswith("lm_head.") or name.startswith("model.norm."):
            return self.is_last
        return True


def pipeline_stage(num_layers: int, rank: int = 0, size: int = 1) -> PipelineStage:
    """Stage `rank` of `size` over `num_layers` decoder layers."""
    if not 0 <= rank < size:
        raise ValueError(f"rank: must be in [0, pipeline_parallel_size={size}), got {rank}")
    if size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size: {size} stages need at least as many decoder layers, the "
            f"model has {num_layers}"
        )
    base, extra = divmod(num_layers, size)
    start = rank * base + min(rank, extra)
    return PipelineStage(rank, size, start, start + base + (1 if rank < extra else 0))


def whole_model(num_layers: int) -> PipelineStage:
    return pipeline_stage(num_layers)


class MissingLayer(nn.Module):
    """Stands in for a decoder layer another pipeline stage holds (no parameters)."""

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("this decoder layer is held by another pipeline stage")


def stage_layers(
    stage: PipelineStage, num_layers: int, make_layer: Callable[[int], nn.Module]
) -> nn.ModuleList:
    """The decoder layers in global order: built for this stage's, MissingLayer elsewhere."""
    return nn.ModuleList(
        make_layer(i) if i in stage.layer_ids else MissingLayer() for i in range(num_layers)
    )


def stage_input(
    embed_tokens: nn.Module | None,
    input_ids: torch.Tensor,
    intermediate: StageActivations | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(hidden, residual) entering the stage's first layer: the embedded ids on the first stage
    (no residual yet), the previous stage's activations on the others."""
    if intermediate is not None:
        return intermediate
    assert embed_tokens is not None, "a stage after the first needs the previous one's output"
    return embed_tokens(input_ids), None


def stage_output(
    norm: nn.Module | None, hidden: torch.Tensor, residual: torch.Tensor | None
) -> torch.Tensor | StageActivations:
    """The last stage's final-normed hidden states, or (hidden, residual) for the next stage."""
    if norm is None:
        assert residual is not None
        return hidden, residual
    if residual is None:
        return norm(hidden)
    hidden, _ = norm(hidden, residual)
    return hidden
