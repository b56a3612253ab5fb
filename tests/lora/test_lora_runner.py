"""The runner's adapter slots and the core's host-cache mirror, driven by hand: token -> slot maps,
least-recently-used slot replacement that spares the step's adapters, dropped adapters zeroed,
and host-cache evictions that spare adapters in use."""

from __future__ import annotations

import pytest
import torch

from ferrum import LoRARequest
from ferrum.lora.weights import load_lora_weights
from ferrum.lora_checkpoint import read_adapter
from ferrum.lora_request import LoRAStep
from ferrum.model_arch import ModelArchConfig
from ferrum.model_folder import read_hf_config
from ferrum.sampling_params import SamplingParams
from ferrum.scheduler.output import NewRequestData, SchedulerOutput
from tests.utils.scheduler_steps import make_request
from tests.utils.tiny_llm import make_llm


def _step(new: dict[str, int | None], updates: dict | None = None) -> SchedulerOutput:
    params = SamplingParams().resolve()
    reqs = [NewRequestData(r, [1], [], params, ([1],), 0) for r in new]
    lora = LoRAStep({r: i for r, i in new.items() if i is not None}, updates or {})
    return SchedulerOutput(reqs, [], {}, 0, lora=lora)


def test_slots_are_replaced_least_recently_used_first(tiny_checkpoint, peft_adapter) -> None:
    base = tiny_checkpoint("llama")
    arch = ModelArchConfig.from_hf_config(read_hf_config(base))
    weights = {
        i: load_lora_weights(
            i, read_adapter(peft_adapter("llama", rank=4, seed=i), arch, 8), torch.float32
        )
        for i in (1, 2, 3)
    }
    llm = make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=16)
    lora = llm.llm_engine.core.executor.runner.lora
    qkv = lora.layers[(0, "self_attn.qkv_proj")]
    lora.apply(_step({"a": 1, "b": None, "c": 2}, {1: weights[1], 2: weights[2]}))
    lora.prepare({"a": 3, "b": 2, "c": 1})
    assert lora.batch.token_slots[:7].tolist() == [0, 0, 0, -1, -1, 1, -1]
    assert dict(lora.slots) == {1: 0, 2: 1}
    a_q = weights[1].modules[(0, "self_attn.qkv_proj")]["q"][0]
    assert torch.equal(qkv.lora_a[0, :4], a_q) and not qkv.lora_a[0, 4:8].any()
    # The model-dtype weight and every slot's A are one extended tensor, A below W's rows.
    weight, n = qkv.base_layer.weight, qkv.base_layer.weight.shape[0]
    assert weight.data_ptr() == qkv.weight_ext.data_ptr()
    assert torch.equal(qkv.weight_ext[n : n + 4], a_q)
    # Adapter 3 for a new request beside c (adapter 2): adapter 1, least recently used, leaves.
    lora.apply(_step({"d": 3}, {3: weights[3]}))
    lora.prepare({"c": 1, "d": 2})
    assert lora.batch.token_slots[:4].tolist() == [1, 0, 0, -1]
    assert dict(lora.slots) == {2: 1, 3: 0}
    # Adapter 2 dropped from the host cache: its slot is zeroed and freed.
    lora.apply(_step({}, {2: None}))
    assert 2 not in lora.host and dict(lora.slots) == {3: 0} and not qkv.lora_b[1].any()
    lora.prepare({"b": 1})
    assert not (lora.batch.token_slots != -1).any()
    assert not lora.batch.active  # an eager step without adapters skips the LoRA work


def test_host_cache_evicts_only_adapters_no_request_uses(tiny_checkpoint, peft_adapter) -> None:
    base = tiny_checkpoint("llama")
    llm = make_llm(base, enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8)
    loads = llm.llm_engine.core.loras
    path = peft_adapter("llama", rank=4, seed=1)
    requests = {}
    for req_id, lora_int_id in (("a", 1), ("b", 2)):
        request = make_request(req_id, 4)
        request.lora = loads.handle(LoRARequest(f"x{lora_int_id}", lora_int_id, path))
        while not request.lora.poll():
            pass
        requests[req_id] = request
    step = loads.step_data(_step({"a": 1}), requests)
    assert list(step.updates) == [1] and step.req_lora_ids == {"a": 1}
    # Adapter 2 arrives while a (adapter 1) still runs: the cache holds both for now.
    step = loads.step_data(_step({"b": 2}), requests)
    assert list(step.updates) == [2] and list(loads.resident) == [1, 2]
    del requests["a"]  # a finished: adapter 1 leaves with the next step
    step = loads.step_data(_step({}), requests)
    assert step.updates == {1: None} and list(loads.resident) == [2]
    assert loads.handle(LoRARequest("x2", 2, path)).poll()  # resident: ready at once
    # A load whose requests ended before admission is dropped with the next step.
    orphan = loads.handle(LoRARequest("x3", 3, path))
    while not orphan.poll():
        pass
    loads.step_data(_step({}), requests)
    assert 3 not in loads._loads


def test_forward_number_is_reset_with_every_layers_t(tiny_checkpoint, monkeypatch) -> None:
    """Every FORWARD_NUMBER_RESET steps the number is 0 again and no layer's t carries one."""
    pytest.importorskip("triton")
    from ferrum.kernels.gemv_lora import UNTAGGED
    from ferrum.lora import runner as runner_module

    monkeypatch.setattr(runner_module, "FORWARD_NUMBER_RESET", 3)
    llm = make_llm(tiny_checkpoint("llama"), enable_lora=True, max_loras=1, num_kv_blocks=16)
    lora = llm.llm_engine.core.executor.runner.lora
    qkv = lora.layers[(0, "self_attn.qkv_proj")]
    qkv.t_scratch = torch.zeros(2, 24, dtype=torch.int64)  # as if a fused launch had written it
    lora.batch.forward_seq.fill_(7)
    for _ in range(3):
        assert lora.batch.forward_seq.item() == 7 and not qkv.t_scratch.any()
        lora.prepare({"a": 1})
    assert lora.batch.forward_seq.item() == 0 and (qkv.t_scratch == UNTAGGED).all()
