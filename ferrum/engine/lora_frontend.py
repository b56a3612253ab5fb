"""The front end's LoRA adapters: every `LoRARequest` is checked once by id (its PEFT folder read
without torch, against the base model: `lora_checkpoint.read_adapter`) before any request of it
reaches a core, and the server's adapters are kept by name (`--lora-modules`,
`/v1/load_lora_adapter`), each with a fresh id: an adapter loaded again after an unload never
shares prefix-cache blocks with its earlier self."""

from __future__ import annotations

from ferrum.config import EngineConfig
from ferrum.errors import FieldError
from ferrum.lora_checkpoint import read_adapter
from ferrum.lora_request import LoRARequest


class LoRAFrontEnd:
    def __init__(self, config: EngineConfig) -> None:
        self.lora_config = config.lora_config
        self.arch = config.model_config.arch
        self._checked: dict[int, LoRARequest] = {}
        # The server's adapters by name, in the order they were added.
        self.by_name: dict[str, LoRARequest] = {}
        # The base model name each server adapter lists as its parent (None: the first served).
        self.parents: dict[str, str | None] = {}
        self._next_id = 1

    def check(self, lora_request: object) -> LoRARequest | None:
        """`lora_request` validated (None: the base model); raises TypeError for another type,
        FieldError("lora_request") for an adapter ferrum cannot serve."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(
                f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}"
            )
        if not self.lora_config.enable_lora:
            raise FieldError(
                "lora_request", "lora_request: LoRA adapters need enable_lora=True (--enable-lora)"
            )
        known = self._checked.get(lora_request.lora_int_id)
        if known is not None and known != lora_request:
            raise FieldError(
                "lora_request",
                f"lora_request: lora_int_id {known.lora_int_id} is adapter {known.lora_name!r} "
                f"at {known.lora_path}; give each adapter its own id",
            )
        if known is None:
            read_adapter(lora_request.lora_path, self.arch, self.lora_config.max_lora_rank)
            self._checked[lora_request.lora_int_id] = lora_request
        return lora_request

    def add(
        self,
        name: str,
        path: str,
        base_names: tuple[str, ...] = (),
        parent: str | None = None,
        replace: bool = False,
    ) -> LoRARequest:
        """Registers a server adapter under `name` (not a served base model name; taken only
        with `replace`, which swaps in the new folder once it is validated); raises FieldError
        naming the problem."""
        if not isinstance(name, str) or not name:
            raise FieldError("lora_name", "lora_name: must be a non-empty string")
        if name in base_names or (name in self.by_name and not replace):
            raise FieldError("lora_name", f"lora_name: {name!r} is already served")
        while self._next_id in self._checked:
            self._next_id += 1
        lora_request = self.check(LoRARequest(name, self._next_id, path))
        assert lora_request is not None
        if name in self.by_name:
            self.remove(name)
        self.by_name[name] = lora_request
        self.parents[name] = parent
        return lora_request

    def remove(self, name: str) -> LoRARequest:
        """Unregisters a server adapter: new requests cannot name it; running ones finish."""
        lora_request = self.by_name.pop(name, None)
        if lora_request is None:
            raise FieldError("lora_name", f"lora_name: no adapter {name!r} is loaded")
        self.parents.pop(name, None)
        self._checked.pop(lora_request.lora_int_id, None)
        return lora_request
