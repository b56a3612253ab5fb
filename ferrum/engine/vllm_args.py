"""vLLM engine arguments ferrum takes without a config field of its own, so that a vLLM launch
script runs: no-ops that say so in one log line at start-up, -O0 mapped to enforce_eager, and
the values ferrum cannot honour refused naming why. Each is an EngineArgs field: an `LLM` keyword
and a flag of the same name. (max_logprobs and generation_config are ModelConfig fields.)"""

from __future__ import annotations

import logging
from typing import Any

from ferrum.errors import FieldError
from ferrum.sampling_params import MAX_LOGPROBS

# name -> the flag's help.
VLLM_ARG_HELP = {
    "enable_chunked_prefill": "always on: prompt chunks and decodes share each step's token "
    "budget (--no-enable-chunked-prefill is refused)",
    "cpu_offload_gb": "0 only: weights stay on the device (a no-op)",
    "swap_space": "a no-op: preempted requests are recomputed, no KV is swapped to the CPU",
    "trust_remote_code": "a no-op: ferrum runs no code from the model folder",
    "disable_log_stats": "no periodic stats line in the server log",
    "tokenizer_mode": "auto (or hf): the fast tokenizer of tokenizer.json; slow, mistral and "
    "custom are refused",
    "max_seq_len_to_capture": "a no-op: CUDA graphs serve every context length",
    "optimization_level": "-O0: no CUDA graphs (enforce_eager); -O1 to -O3: ferrum's default "
    "(CUDA graphs; ferrum does not use torch.compile)",
}
TOKENIZER_MODES = ("auto", "hf")


def _bad(name: str, message: str) -> FieldError:
    return FieldError(name, f"{name}: {message}")


def resolve_vllm_args(values: dict[str, Any], logger: logging.Logger) -> dict[str, Any]:
    """Checks the vLLM arguments in `values` (EngineArgs' fields; FieldError naming the argument),
    logs one line per given no-op, and returns what changes ferrum's own fields (-O0:
    enforce_eager)."""
    notes: list[str] = []
    if values["enable_chunked_prefill"] is False:
        raise _bad(
            "enable_chunked_prefill",
            "False is not supported: ferrum always chunks prefill (prompt chunks and decodes share "
            "each step's max_num_batched_tokens); drop --no-enable-chunked-prefill",
        )
    if values["enable_chunked_prefill"]:
        notes.append("enable_chunked_prefill: has no effect: ferrum always chunks prefill")
    for name in ("cpu_offload_gb", "swap_space"):
        value = values[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise _bad(name, f"must be a number of GiB, got {value!r}")
        if value is not None and value < 0:
            raise _bad(name, f"must be >= 0, got {value!r}")
    if values["cpu_offload_gb"]:
        raise _bad(
            "cpu_offload_gb",
            f"{values['cpu_offload_gb']:g} GiB: not supported yet by ferrum (weights stay on the "
            "device); use 0 or drop it",
        )
    if values["cpu_offload_gb"] is not None:
        notes.append("cpu_offload_gb: has no effect: 0 GiB, weights stay on the device")
    if values["swap_space"] is not None:
        notes.append(
            "swap_space: has no effect: ferrum recomputes preempted requests, it swaps no KV "
            "cache to the CPU"
        )
    if values["trust_remote_code"]:
        notes.append(
            "trust_remote_code: has no effect: ferrum runs no code from the model folder (it "
            "implements each supported architecture itself)"
        )
    if values["tokenizer_mode"] not in TOKENIZER_MODES:
        raise _bad(
            "tokenizer_mode",
            f"{values['tokenizer_mode']!r} is not supported: ferrum uses the fast tokenizer of "
            f"the model's tokenizer.json (tokenizer_mode 'auto' or 'hf')",
        )
    if values["max_seq_len_to_capture"] is not None:
        notes.append(
            "max_seq_len_to_capture: has no effect: ferrum's CUDA graphs serve every context "
            "length (they are captured per batch size, not per sequence length)"
        )
    changes = _optimization_level(values["optimization_level"], notes)
    max_logprobs = values["max_logprobs"]
    if isinstance(max_logprobs, int) and (max_logprobs == -1 or max_logprobs > MAX_LOGPROBS):
        logger.warning(
            "max_logprobs=%d: ferrum returns at most %d logprobs per token; requests asking for "
            "more are refused",
            max_logprobs,
            MAX_LOGPROBS,
        )
    for note in notes:
        logger.info("%s", note)
    return changes


def _optimization_level(level: int | None, notes: list[str]) -> dict[str, Any]:
    if level is None:
        return {}
    if isinstance(level, bool) or level not in (0, 1, 2, 3):
        raise _bad("optimization_level", f"must be 0, 1, 2 or 3 (-O0 .. -O3), got {level!r}")
    if level == 0:
        notes.append("optimization_level 0 (-O0): no CUDA graphs (enforce_eager)")
        return {"enforce_eager": True}
    notes.append(
        f"optimization_level {level} (-O{level}): has no effect: ferrum does not use "
        "torch.compile; CUDA graphs are captured unless --enforce-eager"
    )
    return {}
