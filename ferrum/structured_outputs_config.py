"""How structured outputs compile their grammars: `EngineConfig.structured_outputs_config`."""

from __future__ import annotations

from dataclasses import dataclass

from ferrum.config_fields import field_error as _fail

STRUCTURED_OUTPUT_BACKENDS = ("xgrammar",)


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Grammar compilation for structured outputs (vLLM's field names where vLLM has them)."""

    backend: str = "xgrammar"
    # JSON on one line with no free whitespace between tokens (structural tags' JSON: at most 1
    # blank); False allows pretty JSON, still at most 16 blanks between tokens.
    disable_any_whitespace: bool = True
    # A request whose grammar is not compiled within this many seconds fails with a ValueError.
    compile_timeout_s: float = 10.0
    # Compiled grammars kept for reuse (least recently used dropped first).
    compile_cache_size: int = 256
    # Grammars compiled at once, each on its own thread.
    compile_max_workers: int = 4

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise _fail(
                "backend", f"must be one of {STRUCTURED_OUTPUT_BACKENDS}, got {self.backend!r}"
            )
        timeout = self.compile_timeout_s
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not (0.0 < timeout <= 3600.0)
        ):
            raise _fail(
                "compile_timeout_s",
                f"must be a number in (0, 3600], got {self.compile_timeout_s!r}",
            )
        for name in ("compile_cache_size", "compile_max_workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise _fail(name, f"must be an integer >= 1, got {value!r}")
