"""Where and how the model computes: the device, the kernel backend, CUDA graphs, batch
invariance, the attention backend of long prompt chunks (`DeviceConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ferrum.config_fields import field_error as _fail
from ferrum.config_fields import field_help as _help

KERNEL_BACKENDS = ("auto", "torch", "triton")
# vLLM's names: FLASH_ATTN is FlashAttention-4's CuTe-DSL kernels here (kernels/flash_attn4.py).
ATTENTION_BACKENDS = ("auto", "FLASH_ATTN", "TRITON_ATTN")


@dataclass(frozen=True)
class DeviceConfig:
    device: str = field(default="cpu", metadata=_help("cuda or cpu (default: cuda when available)"))
    kernel_backend: str = field(
        default="auto",
        metadata=_help(
            "auto (Triton on CUDA, torch elsewhere), torch, or triton", choices=KERNEL_BACKENDS
        ),
    )
    enforce_eager: bool = field(default=False, metadata=_help("never capture CUDA graphs"))
    batch_invariant: bool = field(
        default=False,
        metadata=_help(
            "a request's tokens and logprobs do not depend on the batch it runs in, its chunking, "
            "prefix-cache hits or preemption (kernels with one tile per shape; slower)"
        ),
    )
    num_cpu_threads: int | None = field(
        default=None,
        metadata=_help(
            "threads torch computes with on the CPU (default: torch's, one per core); lower it "
            "when other work shares the cores"
        ),
    )
    tuned_config_dir: str | None = field(
        default=None, metadata=_help("`ferrum tune`'s tables (~/.cache/ferrum/tuned_configs)")
    )
    attention_backend: str = field(
        default="auto",
        metadata=_help(
            "attention of long prompt chunks: FLASH_ATTN (FlashAttention-4, the fa4 extra; "
            "Hopper and Blackwell), TRITON_ATTN (ferrum's kernels), or auto (FLASH_ATTN where "
            "it is installed and runs)",
            choices=ATTENTION_BACKENDS,
        ),
    )

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise _fail("device", f"must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.num_cpu_threads is not None and (
            not isinstance(self.num_cpu_threads, int) or self.num_cpu_threads < 1
        ):
            raise _fail("num_cpu_threads", f"must be an integer >= 1, got {self.num_cpu_threads!r}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise _fail(
                "kernel_backend", f"must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise _fail(
                "attention_backend",
                f"must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}",
            )
