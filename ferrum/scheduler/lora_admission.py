"""Which waiting LoRA requests a step may admit: a request's adapter must be loaded (its load
runs off the step loop), and the running requests together use at most the engine's max_loras
adapters, so that no step ever needs more adapter slots than the runner has (running requests
are scheduled first, so this bounds every step). A request that must wait keeps its place."""

from __future__ import annotations

from collections.abc import Iterable

from ferrum.request import Request


def lora_admits(request: Request, running: Iterable[Request]) -> bool:
    """Whether `request` may be admitted now as far as its adapter goes (always, without one).
    Raises the load's error when its adapter failed to load."""
    lora = request.lora
    if lora is None:
        return True
    if not lora.poll():
        return False
    in_use = {r.lora.lora_int_id for r in running if r.lora is not None}
    return lora.lora_int_id in in_use or len(in_use) < lora.max_loras


def lora_adapter_stats(running: Iterable[Request], waiting: Iterable[Request]) -> dict:
    """`SchedulerStats`' LoRA fields: the adapter names of the running and waiting requests."""

    def names(requests: Iterable[Request]) -> tuple[str, ...]:
        return tuple(sorted({r.lora.lora_request.lora_name for r in requests if r.lora}))

    return {"running_lora_adapters": names(running), "waiting_lora_adapters": names(waiting)}
