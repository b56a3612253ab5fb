"""LoRA admission: a request waits (keeping its place) while its adapter loads or while the
running requests already use max_loras adapters; a failed load aborts it; the prefix cache keys
blocks by adapter."""

from __future__ import annotations

from concurrent.futures import Future

from ferrum.lora_request import LoRARequest, RequestLoRA
from tests.utils.scheduler_steps import make_request, make_scheduler, run_step


def _with_adapter(request, lora_int_id: int, max_loras: int, load: Future | None = None):
    lora = LoRARequest(f"a{lora_int_id}", lora_int_id, "/unused")
    request.lora = RequestLoRA(lora, max_loras, load)
    return request


def test_running_requests_use_at_most_max_loras_adapters() -> None:
    scheduler = make_scheduler()
    for req_id, lora_int_id in (("a", 1), ("b", 2), ("c", 1), ("d", 3), ("e", None)):
        request = make_request(req_id, 4)
        scheduler.add_request(
            request if lora_int_id is None else _with_adapter(request, lora_int_id, 2)
        )
    output, _ = run_step(scheduler)
    # d (a third adapter) waits; e (the base model) and c (adapter 1 again) pass it.
    assert [r.req_id for r in output.scheduled_new_reqs] == ["a", "b", "c", "e"]
    assert [r.req_id for r in scheduler.waiting] == ["d"]
    scheduler.finish_requests(["b"], scheduler.requests["b"].status.FINISHED_ABORTED)
    output, _ = run_step(scheduler)
    assert [r.req_id for r in output.scheduled_new_reqs] == ["d"]


def test_requests_wait_for_their_adapter_and_a_failed_load_aborts() -> None:
    scheduler = make_scheduler()
    loading, failing = Future(), Future()
    scheduler.add_request(_with_adapter(make_request("a", 4), 1, 4, loading))
    scheduler.add_request(_with_adapter(make_request("b", 4), 2, 4, failing))
    scheduler.add_request(make_request("c", 4))
    output, _ = run_step(scheduler)
    assert [r.req_id for r in output.scheduled_new_reqs] == ["c"]
    assert [r.req_id for r in scheduler.waiting] == ["a", "b"]
    failing.set_exception(ValueError("LoRA adapter /x: adapter_model.safetensors is missing"))
    loading.set_result(object())
    output, _ = run_step(scheduler)
    assert [r.req_id for r in output.scheduled_new_reqs] == ["a"]
    [(request, reason)] = scheduler.take_failed()
    assert request.req_id == "b" and "is missing" in reason and request.is_finished


def test_prefix_cache_blocks_are_keyed_by_adapter() -> None:
    scheduler = make_scheduler()
    base = make_request("base", 9, max_tokens=1)
    scheduler.add_request(base)
    run_step(scheduler)
    run_step(scheduler)
    kv = scheduler.kv_cache_manager
    same_tokens = [
        make_request("base2", 9, max_tokens=1),
        _with_adapter(make_request("lora", 9, max_tokens=1), 1, 4),
    ]
    assert kv.get_computed_blocks(same_tokens[0])[1] == 8
    assert kv.get_computed_blocks(same_tokens[1])[1] == 0
    assert same_tokens[1].block_hashes[0] != same_tokens[0].block_hashes[0]


def test_a_hash_collision_across_adapters_is_never_a_hit(monkeypatch) -> None:
    """Block hashes that ignore the adapter (a collision): the first block's parent entry (the
    adapter's root) still tells them apart."""
    from ferrum.kv import block_hash

    original = block_hash.hash_block_tokens
    monkeypatch.setattr(
        block_hash, "hash_block_tokens", lambda parent, tokens, extra=None: original(parent, tokens)
    )
    scheduler = make_scheduler()
    scheduler.add_request(_with_adapter(make_request("one", 9, max_tokens=1), 1, 4))
    run_step(scheduler)
    run_step(scheduler)
    kv = scheduler.kv_cache_manager
    other = _with_adapter(make_request("two", 9, max_tokens=1), 2, 4)
    same = _with_adapter(make_request("again", 9, max_tokens=1), 1, 4)
    assert kv.get_computed_blocks(other)[1] == 0
    assert kv.get_computed_blocks(same)[1] == 8
    assert other.block_hashes[:2] == same.block_hashes[:2]  # the collision
    assert kv.get_computed_blocks(make_request("base", 9, max_tokens=1))[1] == 0
