"""The engine core's side of adapters: each adapter is read from its folder on a loader thread
(never on the step loop), and the core mirrors the runner's host cache: it sends an adapter's
weights with the first step that admits one of its requests, and evicts the least recently used
one past max_cpu_loras (told to the runner in the same way), never one that an unfinished
request uses (then the cache stays over its size until such a request ends)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ferrum.config import EngineConfig
from ferrum.lora.weights import LoRAWeights, load_lora_weights
from ferrum.lora_checkpoint import read_adapter
from ferrum.lora_config import LoRAConfig
from ferrum.lora_request import LoRARequest, LoRAStep, RequestLoRA
from ferrum.model_arch import ModelArchConfig
from ferrum.request import Request
from ferrum.scheduler.output import SchedulerOutput


class LoRALoads:
    def __init__(self, config: LoRAConfig, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        self.config = config
        self.arch = arch
        self.dtype = dtype
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ferrum-lora-load")
        self._loads: dict[int, Future[LoRAWeights]] = {}
        # Adapter ids in the runner's host cache, least recently used first.
        self.resident: OrderedDict[int, None] = OrderedDict()

    def _load(self, lora_request: LoRARequest) -> LoRAWeights:
        spec = read_adapter(lora_request.lora_path, self.arch, self.config.max_lora_rank)
        return load_lora_weights(lora_request.lora_int_id, spec, self.dtype)

    def handle(self, lora_request: LoRARequest) -> RequestLoRA:
        """The adapter handle of a new request: ready at once when the runner holds the
        adapter, else a load (shared by the requests of one adapter; a failed one retried)."""
        lora_int_id = lora_request.lora_int_id
        if lora_int_id in self.resident:
            self.resident.move_to_end(lora_int_id)
            return RequestLoRA(lora_request, self.config.max_loras, None)
        load = self._loads.get(lora_int_id)
        if load is None or (load.done() and load.exception() is not None):
            load = self._loads[lora_int_id] = self._pool.submit(self._load, lora_request)
        return RequestLoRA(lora_request, self.config.max_loras, load)

    def step_data(
        self, scheduler_output: SchedulerOutput, requests: Mapping[str, Request]
    ) -> LoRAStep | None:
        """The step's adapters for the runner (None when it needs nothing): its new requests'
        adapter ids, the weights of those the runner lacks, and the evictions that keep the
        host cache within max_cpu_loras."""
        step = LoRAStep()
        for new in scheduler_output.scheduled_new_reqs:
            lora = requests[new.req_id].lora
            if lora is None:
                continue
            lora_int_id = step.req_lora_ids[new.req_id] = lora.lora_int_id
            if lora_int_id in self.resident:
                self.resident.move_to_end(lora_int_id)
                continue
            # The scheduler admitted the request, so its load is done; an adapter the runner
            # held when the request came stays in its cache while the request lives.
            weights = lora.weights()
            assert weights is not None, f"adapter {lora_int_id} left the cache while in use"
            step.updates[lora_int_id] = weights
            self._loads.pop(lora_int_id, None)
            self.resident[lora_int_id] = None
        excess = len(self.resident) - self.config.cpu_capacity
        if excess > 0 or self._loads:
            in_use = {r.lora.lora_int_id for r in requests.values() if r.lora is not None}
            for lora_int_id in [i for i in self.resident if i not in in_use][: max(excess, 0)]:
                del self.resident[lora_int_id]
                step.updates[lora_int_id] = None
            # Loads whose requests all ended (aborted while it loaded): their weights go.
            for lora_int_id in [i for i, f in self._loads.items() if i not in in_use and f.done()]:
                del self._loads[lora_int_id]
        return step if step.req_lora_ids or step.updates else None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def lora_loads(config: EngineConfig) -> LoRALoads | None:
    """The engine core's adapter loads when `enable_lora`, else None."""
    if not config.lora_config.enable_lora:
        return None
    model = config.model_config
    return LoRALoads(config.lora_config, model.arch, getattr(torch, model.dtype))
