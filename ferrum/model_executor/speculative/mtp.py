"""Qwen3.5's multi-token-prediction layer proposes drafts (`method: mtp`): the EAGLE-3 proposer's
machinery (`eagle3.py`: a pass over each target step's rows once its tokens are sampled, then
greedy decode steps in the lookahead slots) around `Qwen3_5MTPHead`, whose step pass reads the
target's final hidden states, copied after each target forward into a buffer of fixed address
(a CUDA graph of the pass reads it). Its tensors come from the target's own checkpoint."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ferrum.config import EngineConfig, ModelConfig
from ferrum.config_fields import field_error
from ferrum.model_executor.input_batch import RequestTokens, StepInputs
from ferrum.model_executor.models.qwen3_5_mtp import MTP_PREFIX, Qwen3_5MTPHead
from ferrum.model_executor.speculative.eagle3 import Eagle3Proposer, head_load_options
from ferrum.model_executor.speculative.eagle3_loader import build_head, load_head_weights
from ferrum.model_executor.weight_loader import (
    SafetensorsCheckpoint,
    WeightFileError,
    materialize,
)

_FIELD = "speculative_config.method"


class MTPProposer(Eagle3Proposer):
    def __init__(
        self,
        config: EngineConfig,
        target: nn.Module,
        max_num_tokens: int,
        kernel_backend: str,
        device: torch.device,
    ) -> None:
        """Loads the head beside `target` (a Qwen3_5ForCausalLM) for steps of up to
        `max_num_tokens` tokens."""
        model_config = config.model_config
        dtype, batch_invariant, dummy_seed = head_load_options(config)
        head = load_mtp_head(
            model_config, target, dtype, device, kernel_backend, batch_invariant, dummy_seed
        )
        arch = model_config.arch
        self.target_hidden = torch.zeros(
            (max_num_tokens, arch.hidden_size), dtype=dtype, device=device
        )
        self.init_head(config, head, arch, self.target_hidden, kernel_backend, device)

    def follow(
        self,
        inputs: StepInputs,
        shape: tuple[int, int] | None,
        num_tokens: int,
        requests: Mapping[str, RequestTokens],
        num_scheduled: Mapping[str, int],
        hidden_states: torch.Tensor | None,
    ) -> None:
        """Copies the target's hidden states of the step's tokens, then as `Eagle3Proposer`."""
        assert hidden_states is not None, "the MTP head runs on the last pipeline stage"
        self.target_hidden[:num_tokens].copy_(hidden_states[:num_tokens])
        super().follow(inputs, shape, num_tokens, requests, num_scheduled, hidden_states)


def load_mtp_head(
    model_config: ModelConfig,
    target: nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    kernel_backend: str,
    batch_invariant: bool,
    dummy_seed: int | None,
) -> Qwen3_5MTPHead:
    """The head on `device` in `dtype`, from the checkpoint's `mtp.*` tensors (random weights
    from `dummy_seed` instead, when given); a checkpoint without them all is refused."""
    head = build_head(
        lambda kernels: Qwen3_5MTPHead(model_config.arch, kernels, target),  # type: ignore[arg-type]
        dtype, device, kernel_backend, batch_invariant, dummy_seed,
    )  # fmt: skip
    if dummy_seed is not None:
        return head
    folder = model_config.model
    try:
        tensors = [
            (name, materialize(t))
            for name, t in SafetensorsCheckpoint(folder)
            if name.startswith(MTP_PREFIX)
        ]
    except (WeightFileError, OSError, RuntimeError) as e:
        raise field_error(_FIELD, f"'mtp' cannot read {folder!r}'s mtp.* tensors: {e}") from e
    if not tensors:
        raise field_error(
            _FIELD, f"'mtp' needs the checkpoint's mtp.* tensors; {folder!r} has none"
        )
    return load_head_weights(head, tensors, _FIELD, f"'mtp': {folder!r}'s mtp.* tensors")
