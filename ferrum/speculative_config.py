"""Speculative decoding: `EngineConfig.speculative_config` (vLLM's `speculative_config` dict).
A proposer guesses the next `num_speculative_tokens` tokens of a request; the target model
verifies them in one forward and keeps the longest prefix its own sampling agrees with."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ferrum.config_fields import field_error as _fail
from ferrum.model_arch import ModelArchConfig

# "replay" is a benchmark proposer, not a product feature: it replays recorded continuations,
# each token replaced by a wrong one with probability 1 - acceptance_rate, always k of them.
# "mtp": the target checkpoint's own multi-token-prediction layer (`mtp.*`, Qwen3.5).
SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle3", "mtp", "replay")
NOT_SUPPORTED_METHODS = ("eagle", "medusa")
# The methods that read no speculative_config.model.
_WITHOUT_MODEL = ("ngram", "mtp")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # The n-gram proposer matches the last n tokens, n from prompt_lookup_max down to _min.
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # No request speculates in a step once this many requests run (None: never turned off).
    disable_by_batch_size: int | None = 16
    # method "draft_model": the draft's model folder; "eagle3": the EAGLE-3 head's folder;
    # "replay": a JSON file
    # {"<prompt ids joined by ','>": [continuation ids]}.
    model: str | None = None
    acceptance_rate: float = 1.0

    def __post_init__(self) -> None:
        if self.method in NOT_SUPPORTED_METHODS:
            raise _fail(
                "speculative_config.method",
                f"{self.method!r} is not supported yet; supported: {SPECULATIVE_METHODS[:4]}",
            )
        if self.method not in SPECULATIVE_METHODS:
            raise _fail(
                "speculative_config.method",
                f"must be one of {SPECULATIVE_METHODS}, got {self.method!r}",
            )
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise _fail(
                "speculative_config.num_speculative_tokens",
                f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}",
            )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if not _is_int(low) or not _is_int(high) or not 1 <= low <= high:
            raise _fail(
                "speculative_config.prompt_lookup_min",
                f"and prompt_lookup_max must be integers with 1 <= min <= max, got {low!r}, "
                f"{high!r}",
            )
        limit = self.disable_by_batch_size
        if limit is not None and (not _is_int(limit) or limit < 1):
            raise _fail(
                "speculative_config.disable_by_batch_size",
                f"must be an integer >= 1 or None, got {limit!r}",
            )
        if self.method not in _WITHOUT_MODEL and not self.model:
            raise _fail("speculative_config.model", f"method {self.method!r} needs it")
        if self.method in _WITHOUT_MODEL and self.model is not None:
            raise _fail("speculative_config.model", f"not used by method {self.method!r}")
        rate = self.acceptance_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise _fail("speculative_config.acceptance_rate", f"must be in [0, 1], got {rate!r}")

    @classmethod
    def from_value(
        cls, value: SpeculativeConfig | dict[str, Any] | None
    ) -> SpeculativeConfig | None:
        """A config from itself, a dict of vLLM's keys, or None (speculation off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config: must be a dict of its fields, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown field(s) {unknown}; known: {sorted(known)}"
            )
        for name in ("method", "num_speculative_tokens"):
            if name not in value:
                raise _fail(f"speculative_config.{name}", "is required")
        return cls(**value)


def check_speculation_fits(
    config: SpeculativeConfig | None, pipeline_parallel_size: int, arch: ModelArchConfig
) -> None:
    """Speculative decoding needs each verifying step's accepted tokens before the next step is
    scheduled: refused with pipeline parallelism. A model with linear-attention layers keeps
    their state after each verified position (`verify_scratch_slots`) to roll them back."""
    if config is None:
        return
    if pipeline_parallel_size > 1:
        raise _fail("speculative_config", "not supported with pipeline_parallel_size > 1")
    if config.method == "mtp" and not arch.architecture.startswith("Qwen3_5"):
        raise _fail(
            "speculative_config.method",
            f"'mtp' runs Qwen3.5's multi-token-prediction layer; {arch.architecture} has none",
        )
    if config.method == "mtp" and arch.mtp_num_hidden_layers != 1:
        raise _fail(
            "speculative_config.method",
            f"'mtp' needs a checkpoint with one multi-token-prediction layer (config.json "
            f"mtp_num_hidden_layers = 1 and its mtp.* tensors); {arch.architecture} has "
            f"mtp_num_hidden_layers = {arch.mtp_num_hidden_layers}",
        )


def num_lookahead_tokens(config: SpeculativeConfig | None) -> int:
    """KV slots a sampling step allocates past its tokens: where a draft model writes the KV of
    the k drafts it decodes, an EAGLE-3 or MTP head that of its k - 1 steps after the first
    (which runs on the step's own positions)."""
    if config is None:
        return 0
    if config.method == "draft_model":
        return config.num_speculative_tokens
    if config.method in ("eagle3", "mtp"):
        return config.num_speculative_tokens - 1
    return 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def max_verifying_requests(max_num_seqs: int, config: SpeculativeConfig | None) -> int:
    """The most requests one step verifies drafts of: fewer than disable_by_batch_size (none
    get drafts once that many run)."""
    if config is None:
        return 0
    limit = config.disable_by_batch_size
    return max_num_seqs if limit is None else min(max_num_seqs, limit - 1)


def max_sampled_rows(max_num_seqs: int, config: SpeculativeConfig | None) -> int:
    """The most rows a step samples (and bitmask rows it needs): a row per request, and one per
    draft of the requests that verify some."""
    if config is None:
        return max_num_seqs
    num_verifying = max_verifying_requests(max_num_seqs, config)
    return max_num_seqs + num_verifying * config.num_speculative_tokens


def verify_scratch_slots(
    max_num_seqs: int, config: SpeculativeConfig | None, arch: ModelArchConfig
) -> int:
    """Linear-attention state slots a runner keeps past the KV manager's (in every such layer's
    pools): k per verifying request, the states after its token and each draft but the last."""
    if config is None or not arch.linear_attention_layers:
        return 0
    return max_verifying_requests(max_num_seqs, config) * config.num_speculative_tokens
