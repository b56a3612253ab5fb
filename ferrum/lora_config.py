"""LoRA serving limits (vLLM's names): how many adapters a step may mix, their largest rank, and
how many stay loaded in host memory. Frozen and validated; errors name the field and the limit."""

from __future__ import annotations

from dataclasses import dataclass, field

from ferrum.config_fields import field_error as _fail
from ferrum.config_fields import field_help as _help
from ferrum.model_arch import ModelArchConfig

# The largest rank ferrum accepts for max_lora_rank (vLLM's largest supported value).
MAX_LORA_RANK_LIMIT = 512


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = field(
        default=False, metadata=_help("serve LoRA adapters (PEFT folders) on the base model")
    )
    max_loras: int = field(
        default=1,
        metadata=_help("most distinct adapters in one step (slots of the device adapter pool)"),
    )
    max_lora_rank: int = field(default=16, metadata=_help("largest adapter rank accepted"))
    max_cpu_loras: int | None = field(
        default=None,
        metadata=_help(
            "adapters kept loaded in host memory, least recently used evicted first (default: "
            "max_loras)"
        ),
    )

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise _fail(name, f"must be an integer >= 1, got {value!r}")
        if self.max_lora_rank > MAX_LORA_RANK_LIMIT:
            raise _fail(
                "max_lora_rank", f"must be <= {MAX_LORA_RANK_LIMIT}, got {self.max_lora_rank}"
            )
        cpu = self.max_cpu_loras
        if cpu is not None and (not isinstance(cpu, int) or isinstance(cpu, bool) or cpu < 1):
            raise _fail("max_cpu_loras", f"must be an integer >= 1, got {cpu!r}")
        if cpu is not None and cpu < self.max_loras:
            raise _fail(
                "max_cpu_loras",
                f"must be >= max_loras={self.max_loras} (every adapter of a step is in host "
                f"memory), got {cpu}",
            )

    @property
    def cpu_capacity(self) -> int:
        """Adapters kept in host memory."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


def check_lora_fits(lora_config: LoRAConfig, arch: ModelArchConfig, batch_invariant: bool) -> None:
    """Refuses `enable_lora` where ferrum cannot serve adapters exactly, naming why."""
    if not lora_config.enable_lora:
        return
    if arch.linear_attention_layers:
        raise _fail(
            "enable_lora",
            f"not supported for {arch.architecture}: LoRA covers the attention and MLP "
            "projections of models with full attention only (no linear-attention layers)",
        )
    if batch_invariant:
        raise _fail("enable_lora", "not supported with batch_invariant (no invariant LoRA kernels)")
