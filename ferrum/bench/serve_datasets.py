"""Request sets of `ferrum bench serve`: `random`, `sharegpt` (a local JSON file) and `prefix`.

Every sample carries its prompt both as token ids (sent as-is to /v1/completions, so the server
sees exactly `prompt_len` tokens) and as text (sent to /v1/chat/completions; `prompt_len` is then
the token count of that text re-encoded by the same tokenizer)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ferrum.engine.tokenizer import Tokenizer

DATASETS = ("random", "sharegpt", "prefix")
# ShareGPT filters (the usual ones): drop very short turns and very long conversations.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass(slots=True)
class SampleRequest:
    prompt_token_ids: list[int]
    prompt_text: str
    prompt_len: int
    output_len: int


def length_range(mean: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [mean * (1 - r), mean * (1 + r)], never below 1."""
    return max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))


class TokenSampler:
    """Uniform random token ids of one tokenizer, special tokens excluded."""

    def __init__(self, tokenizer: Tokenizer, rng: random.Random) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        special = tokenizer.all_special_ids
        self.token_ids = [i for i in range(tokenizer.vocab_size) if i not in special]
        if not self.token_ids:
            raise ValueError("tokenizer has no non-special tokens to sample prompts from")

    def sample(self, num_tokens: int) -> list[int]:
        return self.rng.choices(self.token_ids, k=num_tokens)


def make_sample(
    tokenizer: Tokenizer, token_ids: list[int], output_len: int, chat: bool
) -> SampleRequest:
    """For chat the text is what is sent, so its re-encoded length is the prompt length."""
    text = tokenizer.decode(token_ids, skip_special_tokens=False)
    prompt_len = len(tokenizer.encode(text, add_special_tokens=False)) if chat else len(token_ids)
    return SampleRequest(token_ids, text, prompt_len, output_len)


def random_dataset(
    tokenizer: Tokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    chat: bool = False,
) -> list[SampleRequest]:
    """Prompts of uniform random tokens; input and output lengths uniform in their ranges."""
    _check_positive(num_prompts=num_prompts, random_input_len=input_len)
    _check_positive(random_output_len=output_len)
    _check_range_ratio(range_ratio)
    rng = random.Random(seed)
    sampler = TokenSampler(tokenizer, rng)
    in_low, in_high = length_range(input_len, range_ratio)
    out_low, out_high = length_range(output_len, range_ratio)
    samples = []
    for _ in range(num_prompts):
        token_ids = sampler.sample(rng.randint(in_low, in_high))
        samples.append(make_sample(tokenizer, token_ids, rng.randint(out_low, out_high), chat))
    return samples


def prefix_dataset(
    tokenizer: Tokenizer,
    num_prompts: int,
    prefix_len: int,
    num_prefix_groups: int,
    suffix_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    chat: bool = False,
) -> list[SampleRequest]:
    """`num_prefix_groups` random prefixes of `prefix_len` tokens; prompt i is prefix
    i % num_prefix_groups plus its own random suffix (length around `suffix_len`)."""
    _check_positive(num_prompts=num_prompts, prefix_len=prefix_len)
    _check_positive(num_prefix_groups=num_prefix_groups, random_input_len=suffix_len)
    _check_positive(random_output_len=output_len)
    _check_range_ratio(range_ratio)
    rng = random.Random(seed)
    sampler = TokenSampler(tokenizer, rng)
    prefixes = [sampler.sample(prefix_len) for _ in range(num_prefix_groups)]
    in_low, in_high = length_range(suffix_len, range_ratio)
    out_low, out_high = length_range(output_len, range_ratio)
    samples = []
    for i in range(num_prompts):
        token_ids = prefixes[i % num_prefix_groups] + sampler.sample(rng.randint(in_low, in_high))
        samples.append(make_sample(tokenizer, token_ids, rng.randint(out_low, out_high), chat))
    return samples


def sharegpt_dataset(
    tokenizer: Tokenizer,
    path: str,
    num_prompts: int,
    seed: int,
    output_len: int | None = None,
) -> list[SampleRequest]:
    """The first human turn of each conversation as the prompt; the next turn's token count as
    the output length (or `output_len`). Conversations are shuffled with `seed`."""
    _check_positive(num_prompts=num_prompts)
    if output_len is not None:
        _check_positive(sharegpt_output_len=output_len)
    entries = _read_sharegpt(path)
    random.Random(seed).shuffle(entries)
    samples = []
    for prompt, completion in entries:
        token_ids = tokenizer.encode(prompt, add_special_tokens=False)
        wanted = output_len or len(tokenizer.encode(completion, add_special_tokens=False))
        if output_len is None and (
            len(token_ids) < SHAREGPT_MIN_LEN
            or wanted < SHAREGPT_MIN_LEN
            or len(token_ids) > SHAREGPT_MAX_PROMPT_LEN
            or len(token_ids) + wanted > SHAREGPT_MAX_TOTAL_LEN
        ):
            continue
        if not token_ids:
            continue
        samples.append(SampleRequest(token_ids, prompt, len(token_ids), wanted))
        if len(samples) == num_prompts:
            break
    if len(samples) < num_prompts:
        raise ValueError(
            f"dataset_path {path!r} has only {len(samples)} usable conversations, "
            f"num_prompts asks for {num_prompts}"
        )
    return samples


def _read_sharegpt(path: str) -> list[tuple[str, str]]:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"dataset_path {path!r} is not a file")
    try:
        data: Any = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"dataset_path {path!r} is not valid JSON: {e}") from e
    if not isinstance(data, list):
        raise ValueError(f"dataset_path {path!r} must hold a JSON list of conversations")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        prompt, completion = first.get("value"), second.get("value")
        if isinstance(prompt, str) and isinstance(completion, str):
            pairs.append((prompt, completion))
    return pairs


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def _check_range_ratio(range_ratio: float) -> None:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}")
