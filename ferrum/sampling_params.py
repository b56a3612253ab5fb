"""Sampling parameters with vLLM's names, defaults and validation."""

from __future__ import annotations

import json as json_lib
from collections.abc import Iterable
from copy import deepcopy
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ferrum.errors import FieldError

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


# The structured-output kinds of StructuredOutputsParams; exactly one is set per request.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# OpenAI's bound on a logit_bias value.
MAX_LOGIT_BIAS = 100.0

# Bounds on what one request may ask the front end and each engine step to walk: generous for real
# use (OpenAI allows 4 stop strings), small enough that indexing stop strings, tokenizing bad
# words, compiling choices and masking token ids per step stay well under a millisecond a token.
MAX_LIST_ITEMS = 1024  # stop, stop_token_ids, bad_words, logit_bias, structured_outputs.choice
MAX_LIST_CHARS = 16384  # the characters of stop, bad_words, structured_outputs.choice, each
MAX_ALLOWED_TOKEN_IDS = 16384  # a subset of the vocabulary may be sizeable
# Deepest nesting of a JSON value in a request (a schema, template kwargs): real schemas nest a
# few levels; copying, pickling to the core and rendering walk it recursively (Python's stack
# holds about 1000 frames), so 64 keeps every walk far from RecursionError. Grammars may nest
# twice as deep: the server wraps a request's schema (tool-call tags, reasoning) into one.
MAX_JSON_DEPTH = 64
MAX_GRAMMAR_JSON_DEPTH = 2 * MAX_JSON_DEPTH


def json_depth_exceeds(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether dicts and lists nest more than `limit` levels in `value` (iterative: a value
    of any depth is measured without recursion)."""
    stack = [(value, 1)] if isinstance(value, dict | list | tuple) else []
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list | tuple))
    return False


def check_list(name: str, values: Any, max_items: int, max_chars: int | None = None) -> None:
    """FieldError naming `name` when `values` holds more than `max_items` items or (strings)
    more than `max_chars` characters in all."""
    if len(values) > max_items:
        raise FieldError(name, f"{name} holds {len(values)} items; the limit is {max_items}")
    num_chars = 0 if max_chars is None else sum(len(v) for v in values if isinstance(v, str))
    if max_chars is not None and num_chars > max_chars:
        raise FieldError(
            name, f"{name} holds {num_chars} characters in all; the limit is {max_chars}"
        )


@dataclass
class StructuredOutputsParams:
    """Constrains the output to a JSON schema, a regex, one of fixed strings, an EBNF grammar
    (xgrammar's GBNF, root rule `root`), any JSON object, or an xgrammar structural tag (vLLM's
    names). Exactly one is set; `json` and `structural_tag` are dicts or JSON text. This checks the
    fields' shapes only: the grammar compiler raises ValueError for what does not compile.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        def bad(name: str, limit: str, value: object) -> FieldError:
            return FieldError(
                "structured_outputs", f"structured_outputs.{name} {limit}, got {value!r:.200}"
            )

        for name, what in (("json", "a JSON schema"), ("structural_tag", "a structural tag")):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, str):
                try:
                    value = json_lib.loads(value)
                except (json_lib.JSONDecodeError, RecursionError) as e:
                    raise bad(name, f"must be {what}; the string is not JSON ({e})", value) from e
            if not isinstance(value, dict):
                raise bad(name, f"must be {what} object (a dict or its JSON text)", value)
            if json_depth_exceeds(value, MAX_GRAMMAR_JSON_DEPTH):
                limit = (
                    f"structured_outputs.{name} nests deeper than {MAX_GRAMMAR_JSON_DEPTH} levels"
                )
                raise FieldError("structured_outputs", limit)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise bad(name, "must be a non-empty string", value)
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                raise bad("choice", "must be a list of strings", self.choice)
            self.choice = list(self.choice)
            if not self.choice:
                raise bad("choice", "must hold at least one string", self.choice)
            check_list("structured_outputs.choice", self.choice, MAX_LIST_ITEMS, MAX_LIST_CHARS)
            for option in self.choice:
                if not isinstance(option, str) or not option:
                    raise bad("choice", "must contain only non-empty strings", option)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise bad("json_object", "must be a bool", self.json_object)
        kinds = self.kinds_set()
        if len(kinds) != 1:
            raise FieldError(
                "structured_outputs",
                f"structured_outputs: exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)} "
                f"must be set, got {', '.join(kinds) if kinds else 'none'}",
            )

    def kinds_set(self) -> list[str]:
        """The names of the set fields (`json_object=False` counts as not set)."""
        return [
            name
            for name in STRUCTURED_OUTPUT_KINDS
            if getattr(self, name) is not None and getattr(self, name) is not False
        ]

    @property
    def kind(self) -> str:
        """The one set field's name."""
        return self.kinds_set()[0]


def _bad(name: str, limit: str, value: object) -> FieldError:
    return FieldError(name, f"SamplingParams.{name} {limit}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
    structured_outputs: StructuredOutputsParams | None = None
    # Token id -> value added to its logit before sampling, in [-100, 100].
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    # Words never generated: a word's last token is banned where the output ends with its others.
    bad_words: list[str] | None = None
    # Per prompt position, the logprob of its token given the prefix plus the top-k.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, tuple):
            self.bad_words = list(self.bad_words)
        if self.top_k is None or (isinstance(self.top_k, int) and self.top_k < 0):
            # vLLM accepts -1 (and None) for "disabled"; 0 is the canonical spelling.
            self.top_k = 0 if self.top_k is None or self.top_k == -1 else self.top_k
        self._verify()
        if self.temperature < _GREEDY_EPS:
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify(self) -> None:
        """Numbers and lengths first, then the token and text fields."""
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise _bad("n", f"must be an integer in [1, {MAX_N}]", self.n)
        for name, low, high in (
            ("presence_penalty", -2.0, 2.0),
            ("frequency_penalty", -2.0, 2.0),
            ("temperature", 0.0, 100.0),
            ("min_p", 0.0, 1.0),
        ):
            value = getattr(self, name)
            if not _is_real(value) or not low <= value <= high:
                raise _bad(name, f"must be a number in [{low:g}, {high:g}]", value)
        if not _is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise _bad("repetition_penalty", "must be a number in (0, 2]", self.repetition_penalty)
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", "must be a number in (0, 1]", self.top_p)
        if not _is_int(self.top_k) or self.top_k < 0:
            raise _bad("top_k", "must be 0 or -1 (disabled) or a positive integer", self.top_k)
        # Completion i of n draws from seed + i: all of them must be valid 64-bit seeds.
        if self.seed is not None and (
            not _is_int(self.seed) or not -(2**63) <= self.seed <= 2**63 - self.n
        ):
            raise _bad("seed", "must be an integer in [-2**63, 2**63 - n] or None", self.seed)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise _bad("max_tokens", "must be an integer >= 1", self.max_tokens)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise _bad("min_tokens", "must be an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", f"must be <= max_tokens={self.max_tokens}", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise _bad(name, f"must be an integer in [0, {MAX_LOGPROBS}]", value)
        self._verify_token_fields()

    def _verify_token_fields(self) -> None:
        check_list("stop", self.stop, MAX_LIST_ITEMS, MAX_LIST_CHARS)
        check_list("stop_token_ids", self.stop_token_ids, MAX_LIST_ITEMS)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise _bad("stop", "must contain only non-empty strings", s)
        if self.stop and not self.detokenize:
            raise _bad("stop", "strings need detokenize=True", self.stop)
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise _bad("stop_token_ids", "must contain only non-negative integers", t)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise _bad(
                "structured_outputs",
                "must be a StructuredOutputsParams or None",
                self.structured_outputs,
            )
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise _bad("logit_bias", "must be a dict of token id -> bias", self.logit_bias)
            check_list("logit_bias", self.logit_bias, MAX_LIST_ITEMS)
            for token_id, bias in self.logit_bias.items():
                if not _is_int(token_id) or token_id < 0:
                    raise _bad(
                        "logit_bias", "keys must be non-negative integer token ids", token_id
                    )
                if not _is_real(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                    raise _bad(
                        "logit_bias",
                        f"values must be numbers in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
                        bias,
                    )
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise _bad(
                    "allowed_token_ids",
                    "must be a non-empty list of token ids",
                    self.allowed_token_ids,
                )
            check_list("allowed_token_ids", self.allowed_token_ids, MAX_ALLOWED_TOKEN_IDS)
            for t in self.allowed_token_ids:
                if not _is_int(t) or t < 0:
                    raise _bad("allowed_token_ids", "must contain only non-negative integers", t)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list):
                raise _bad("bad_words", "must be a list of strings", self.bad_words)
            check_list("bad_words", self.bad_words, MAX_LIST_ITEMS, MAX_LIST_CHARS)
            for word in self.bad_words:
                if not isinstance(word, str) or not word.strip():
                    raise _bad("bad_words", "must contain only non-blank strings", word)

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's `clone`); the engine never changes the params it is given."""
        return deepcopy(self)

    def resolve(
        self,
        max_tokens: int | None = None,
        seed: int | None = None,
        stop_token_ids: Iterable[int] = (),
        bad_words_token_ids: Iterable[Iterable[int]] = (),
    ) -> ResolvedSamplingParams:
        """What the engine core runs: these params with `max_tokens` (default: this one's) and
        `seed` (default: this one's) resolved, stopped by `stop_token_ids` (the model's EOS ids)
        as well as this one's (`stop_token_ids` only), banning `bad_words_token_ids`."""
        max_tokens = self.max_tokens if max_tokens is None else max_tokens
        assert max_tokens is not None, "max_tokens is resolved before a request is queued"
        return ResolvedSamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed if seed is None else seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            logit_bias=None if self.logit_bias is None else dict(self.logit_bias),
            allowed_token_ids=(
                None if self.allowed_token_ids is None else tuple(self.allowed_token_ids)
            ),
            structured_outputs=self.structured_outputs,
            all_stop_token_ids=frozenset((*self.stop_token_ids, *stop_token_ids)),
            bad_words_token_ids=tuple(tuple(ids) for ids in bad_words_token_ids),
        )


@dataclass(frozen=True, slots=True)
class ResolvedSamplingParams:
    """One completion's sampling as the engine core runs it, built once by the front end
    (`SamplingParams.resolve`): the user's values, plus what only the engine knows."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    # This completion's: completion i of n draws from the request's seed + i.
    seed: int | None
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    logprobs: int | None
    prompt_logprobs: int | None
    logit_bias: dict[int, float] | None
    allowed_token_ids: tuple[int, ...] | None
    structured_outputs: StructuredOutputsParams | None
    # stop_token_ids, and the model's EOS ids unless ignore_eos.
    all_stop_token_ids: frozenset[int]
    # Each bad word's token ids, with and without a leading space.
    bad_words_token_ids: tuple[tuple[int, ...], ...]

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
