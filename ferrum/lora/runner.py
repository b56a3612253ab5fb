"""The model runner's adapters: the host cache of adapter weights the engine core sends (it
decides what is cached: `loads.py`), `max_loras` device slots filled from it, least recently used
slot replaced first, and each step's token -> slot map. Invariant: a step's adapters are all in
the host cache and number at most max_loras (the scheduler admits no more), so every one gets a
slot; adapter ids never change a shape, only the slot map's values."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from ferrum.config import EngineConfig
from ferrum.lora.layers import LoRABatch, LoRALinear, install_lora_layers
from ferrum.lora.weights import LoRAWeights
from ferrum.lora_config import LoRAConfig
from ferrum.model_executor.staging_buffer import StagingBuffer, staging_bytes
from ferrum.scheduler.output import SchedulerOutput

# Steps between resets of the forward number: the fused GEMV compares it 32 bits wide, so it is
# reset (every layer's t untagged) long before it could come round to a number a layer's t
# still carries (a step runs one forward).
FORWARD_NUMBER_RESET = 1 << 30


class LoRARunner:
    def __init__(
        self,
        model: nn.Module,
        config: LoRAConfig,
        max_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_loras = config.max_loras
        kernels = model.kernels
        self.batch = LoRABatch(
            max_tokens,
            config.max_loras,
            device,
            kernels.is_triton,
            not kernels.batch_invariant,
            kernels.dense_linear,
        )
        self.layers: dict[tuple[int, str], LoRALinear] = install_lora_layers(
            model, self.batch, config.max_loras, config.max_lora_rank, dtype
        )
        self.host: dict[int, LoRAWeights] = {}
        # Adapter id -> device slot, least recently used first.
        self.slots: OrderedDict[int, int] = OrderedDict()
        self.req_lora_ids: dict[str, int] = {}
        self.max_tokens = max_tokens
        # The slot map goes up through pinned memory (never waiting for the device), then into
        # the persistent buffer by a device copy.
        self._staging = StagingBuffer(staging_bytes((max_tokens, torch.int32)), device)
        self._pin = device.type == "cuda"
        # Whether the previous step had a token with an adapter (else the map is all -1 already).
        self._marked = False
        self._steps = 0

    def apply(self, scheduler_output: SchedulerOutput) -> None:
        """Takes the step's adapter updates (new weights, or None: dropped from the host cache
        and its slot) and the adapter of each new request."""
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self.req_lora_ids.pop(req_id, None)
        step = scheduler_output.lora
        if step is None:
            return
        for lora_int_id, weights in step.updates.items():
            if weights is None:
                self.host.pop(lora_int_id, None)
                slot = self.slots.pop(lora_int_id, None)
                if slot is not None:
                    self._fill_slot(slot, None)
            else:
                self.host[lora_int_id] = _pinned(weights) if self._pin else weights
        self.req_lora_ids.update(step.req_lora_ids)

    def prepare(self, num_scheduled_tokens: dict[str, int]) -> None:
        """Puts the step's adapters in slots and writes the token -> slot map (tokens in
        scheduling order; every other entry -1)."""
        self._steps += 1
        if self._steps >= FORWARD_NUMBER_RESET:
            self._steps = 0
            self.batch.reset_forward_numbers(self.layers.values())
        lora_ids = self.req_lora_ids
        wanted = {lora_ids[r] for r in num_scheduled_tokens if r in lora_ids}
        self.batch.active = bool(wanted)
        if not wanted and not self._marked:
            return
        assert len(wanted) <= self.max_loras, f"{len(wanted)} adapters > max_loras"
        slot_of = {lora_int_id: self._slot_for(lora_int_id, wanted) for lora_int_id in wanted}
        self._staging.begin()
        slots_np, staged = self._staging.take(self.max_tokens, torch.int32)
        slots_np[:] = -1
        offset = 0
        for req_id, n in num_scheduled_tokens.items():
            lora_int_id = lora_ids.get(req_id)
            if lora_int_id is not None:
                slots_np[offset : offset + n] = slot_of[lora_int_id]
            offset += n
        self._staging.copy()
        self.batch.token_slots.copy_(staged)
        self.batch.regroup()
        self._marked = bool(wanted)

    def _slot_for(self, lora_int_id: int, wanted: set[int]) -> int:
        """The adapter's slot, filling a free one or the least recently used one that this step
        does not need."""
        slot = self.slots.get(lora_int_id)
        if slot is not None:
            self.slots.move_to_end(lora_int_id)
            return slot
        if len(self.slots) < self.max_loras:
            slot = next(s for s in range(self.max_loras) if s not in self.slots.values())
        else:
            victim = next(i for i in self.slots if i not in wanted)
            slot = self.slots.pop(victim)
        self._fill_slot(slot, self.host[lora_int_id])
        self.slots[lora_int_id] = slot
        return slot

    def _fill_slot(self, slot: int, weights: LoRAWeights | None) -> None:
        for key, layer in self.layers.items():
            layer.set_slot(slot, None if weights is None else weights.modules.get(key))


def _pinned(weights: LoRAWeights) -> LoRAWeights:
    """The adapter in pinned host memory: slot fills then never wait for the device."""
    modules = {
        key: {shard: (a.pin_memory(), b.pin_memory()) for shard, (a, b) in shards.items()}
        for key, shards in weights.modules.items()
    }
    return LoRAWeights(weights.lora_int_id, weights.rank, modules)


def lora_runner(
    model: nn.Module, config: EngineConfig, dtype: torch.dtype, device: torch.device
) -> LoRARunner | None:
    """The runner's adapters when `enable_lora`, else None."""
    lora_config = config.lora_config
    if not lora_config.enable_lora:
        return None
    sched = config.scheduler_config
    # The input buffers' token capacity (`ModelRunner.inputs`): a step or a padded graph batch.
    max_tokens = max(sched.max_num_batched_tokens, min(sched.max_num_seqs, 512))
    return LoRARunner(model, lora_config, max_tokens, dtype, device)
