"""What names a LoRA adapter in a request (vLLM's `LoRARequest`), and the handle the engine core
puts on a request while its adapter loads off the step loop. Plain Python: no torch."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ferrum.errors import FieldError


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter: `lora_name` (what a server request's `model` field names), `lora_int_id` (a
    unique integer >= 1 per adapter: the engine's key for its weights and its prefix cache) and
    `lora_path` (a PEFT folder: adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise FieldError("lora_request", "lora_request.lora_name: must be a non-empty string")
        if (
            not isinstance(self.lora_int_id, int)
            or isinstance(self.lora_int_id, bool)
            or self.lora_int_id < 1
        ):
            raise FieldError(
                "lora_request",
                f"lora_request.lora_int_id: must be an integer >= 1, got {self.lora_int_id!r}",
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise FieldError("lora_request", "lora_request.lora_path: must be a non-empty string")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id


class RequestLoRA:
    """A request's adapter in the engine core: its id, the engine's max_loras and the load of
    its weights (a future the core's loader thread completes). `poll` never blocks: True once
    the weights are in memory, and it raises the load's error if the load failed."""

    __slots__ = ("lora_request", "max_loras", "_load")

    def __init__(self, lora_request: LoRARequest, max_loras: int, load: Future[Any] | None) -> None:
        self.lora_request = lora_request
        # The engine's max_loras: the most adapters its running requests may use.
        self.max_loras = max_loras
        # None: the runner already holds the adapter.
        self._load = load

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id

    @property
    def loading(self) -> bool:
        """The load is still running."""
        return self._load is not None and not self._load.done()

    def poll(self) -> bool:
        if self._load is None:
            return True
        if not self._load.done():
            return False
        self._load.result()  # raises the load's error
        return True

    def weights(self) -> Any:
        """The loaded weights once `poll` is True (None when the runner held them already)."""
        return None if self._load is None else self._load.result()


@dataclass(slots=True)
class LoRAStep:
    """What one step tells the model runner about adapters (`SchedulerOutput.lora`)."""

    # The adapter id of each new (or resumed) request of the step that has one.
    req_lora_ids: dict[str, int] = field(default_factory=dict)
    # Adapter id -> its weights (a `ferrum.lora.weights.LoRAWeights`) for the runner's host
    # cache, or None: dropped from it (and from its device slot).
    updates: dict[int, Any] = field(default_factory=dict)
