"""A pipeline stage's traffic: the previous stage's activations in, its own out, and the last
stage's sampled tokens to every rank (read when the step completes). Under a CUDA graph every
stage pads a step to the same shape, so the padded activations match the receiver's buffer. With
one stage each method is the plain local call behind one branch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ferrum.distributed.pipeline_group import PipelineGroup

if TYPE_CHECKING:
    from ferrum.model_executor.cuda_graph import CUDAGraphRunner
    from ferrum.model_executor.input_batch import StepInputs
    from ferrum.model_executor.runner_state import LaunchedStep


@dataclass(slots=True)
class StageTransport:
    group: PipelineGroup
    model: nn.Module
    hidden_size: int
    dtype: torch.dtype
    device: torch.device

    def run_eager(self, inputs: StepInputs, num_tokens: int) -> torch.Tensor | None:
        """This rank's part of an eager forward of `num_tokens` tokens: the whole model, or its
        stage between receiving the previous stage's activations and sending its own (None then,
        before the last stage)."""
        group = self.group
        if group.size == 1:
            return self.model(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        intermediate = None
        if not group.is_first:
            shape = (2, num_tokens, self.hidden_size)
            received = torch.empty(shape, dtype=self.dtype, device=self.device)
            group.recv_from_prev(received)
            intermediate = (received[0], received[1])
        ids, positions = inputs.input_ids[:num_tokens], inputs.positions[:num_tokens]
        out = self.model(ids, positions, inputs.attn_metadata, intermediate)
        if group.is_last:
            return out
        hidden, residual = out
        group.send_to_next(torch.stack((hidden[:num_tokens], residual[:num_tokens])))
        return None

    def replay(
        self, graphs: CUDAGraphRunner, shape: tuple[int, int], num_tokens: int
    ) -> torch.Tensor | None:
        """`run_eager` by the graph of `shape`; the activations go over padded."""
        group = self.group
        if group.size == 1:
            return graphs.replay(shape, num_tokens)
        if not group.is_first:
            group.recv_from_prev(graphs.stage_input(shape[0]))
        output = graphs.replay(shape, num_tokens)
        if group.is_last:
            return output
        group.send_to_next(torch.stack(output))
        return None

    def send_tokens(self, step: LaunchedStep, sampled: torch.Tensor) -> None:
        """The last stage: starts broadcasting the step's sampled tokens to every rank."""
        group = self.group
        if group.size > 1:
            # Every rank of the last stage sampled the same tokens: the root's go out.
            tokens = sampled if group.is_token_root else torch.empty_like(sampled)
            step.token_broadcast = (tokens, group.broadcast_tokens(tokens))

    def receive_tokens(self, step: LaunchedStep) -> None:
        """A stage before the last: joins the broadcast of the step's tokens (stream-ordered)."""
        tokens = torch.empty(len(step.req_ids), dtype=torch.int64, device=self.device)
        step.token_broadcast = (tokens, self.group.broadcast_tokens(tokens))

    @staticmethod
    def wait_tokens(step: LaunchedStep) -> torch.Tensor:
        """The step's broadcast tokens, safe to read (on CUDA: on the current stream)."""
        assert step.token_broadcast is not None
        tokens, work = step.token_broadcast
        if work is not None:
            work.wait()
        return tokens
