"""Sampling parameters with vLLM's names, defaults and validation."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

# Temperatures below this are treated as greedy decoding.
_GREEDY_EPS = 1e-5
# The most top-k / sampled-token logprobs one request may ask for.
MAX_LOGPROBS = 20
# The most completions one request may ask for.
MAX_N = 1024


class RequestOutputKind(Enum):
    """What each output holds: everything so far, what is new since the previous output, or
    (one output, when the request finishes) everything."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingType(Enum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """How to pick each output token and when to stop.

    Field names and defaults follow vLLM's `SamplingParams`; invalid values raise `ValueError`
    naming the field and its limit.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled by the engine from the model's generation config; never part of the user's request.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or (isinstance(self.top_k, int) and self.top_k < 0):
            # vLLM accepts -1 (and None) for "disabled"; 0 is the canonical spelling.
            self.top_k = 0 if self.top_k is None or self.top_k == -1 else self.top_k
        self._verify()
        if self.temperature < _GREEDY_EPS:
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        def bad(name: str, limit: str, value: object) -> ValueError:
            return ValueError(f"SamplingParams.{name} {limit}, got {value!r}")

        def is_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def is_real(value: object) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}]", self.n)
        for name, low, high in (
            ("presence_penalty", -2.0, 2.0),
            ("frequency_penalty", -2.0, 2.0),
            ("temperature", 0.0, 100.0),
            ("min_p", 0.0, 1.0),
        ):
            value = getattr(self, name)
            if not is_real(value) or not low <= value <= high:
                raise bad(name, f"must be a number in [{low:g}, {high:g}]", value)
        if not is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "must be a number in (0, 2]", self.repetition_penalty)
        if not is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be a number in (0, 1]", self.top_p)
        if not is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "must be 0 or -1 (disabled) or a positive integer", self.top_k)
        # Completion i of n draws from seed + i: all of them must be valid 64-bit seeds.
        if self.seed is not None and (
            not is_int(self.seed) or not -(2**63) <= self.seed <= 2**63 - self.n
        ):
            raise bad("seed", "must be an integer in [-2**63, 2**63 - n] or None", self.seed)
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1", self.max_tokens)
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens={self.max_tokens}", self.min_tokens)
        if self.logprobs is not None and (
            not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]", self.logprobs)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", "must contain only non-empty strings", s)
        if self.stop and not self.detokenize:
            raise bad("stop", "strings need detokenize=True", self.stop)
        for t in self.stop_token_ids:
            if not is_int(t) or t < 0:
                raise bad("stop_token_ids", "must contain only non-negative integers", t)

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature == 0.0:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self) -> SamplingParams:
        copy = SamplingParams.__new__(SamplingParams)
        copy.__dict__.update(self.__dict__)
        copy.stop = list(self.stop)
        copy.stop_token_ids = list(self.stop_token_ids)
        copy.all_stop_token_ids = set(self.all_stop_token_ids)
        return copy
