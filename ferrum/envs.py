"""The only module that touches os.environ: a few typed FERRUM_* debugging knobs, and the
variables ferrum hands to libraries and child processes (Triton's interpreter, Ray's address,
the devices a worker sees). Everything that changes what the engine computes is a config field
and a CLI flag, never one of these."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _get(name: str, default: str) -> str:
    return os.environ.get(name, default)


LOGGING_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def logging_level() -> str:
    """FERRUM_LOGGING_LEVEL: log level of the `ferrum` logger (default INFO); any other value
    than LOGGING_LEVELS (in any case) is a ValueError naming the variable."""
    value = _get("FERRUM_LOGGING_LEVEL", "INFO")
    level = value.strip().upper()
    if level == "WARN":
        level = "WARNING"
    if level not in LOGGING_LEVELS:
        raise ValueError(
            f"FERRUM_LOGGING_LEVEL={value!r} is not a log level; use one of "
            f"{', '.join(LOGGING_LEVELS)}"
        )
    return level


def log_stats_interval() -> float:
    """FERRUM_LOG_STATS_INTERVAL: seconds between the server's stats lines (default 10, as
    vLLM's VLLM_LOG_STATS_INTERVAL); unset, malformed or <= 0 means the default."""
    try:
        seconds = float(_get("FERRUM_LOG_STATS_INTERVAL", ""))
    except ValueError:
        return 10.0
    return seconds if seconds > 0 else 10.0


def triton_interpret() -> bool:
    """TRITON_INTERPRET: whether Triton kernels run in the CPU interpreter."""
    return _get("TRITON_INTERPRET", "0") == "1"


def debug_fail_forward() -> int | None:
    """FERRUM_DEBUG_FAIL_FORWARD=N: the first engine core raises in its Nth non-empty forward
    (1-based); cores started after it (restarts) do not. A test-only fault hook; unset or <= 0
    disables it."""
    return _positive_int("FERRUM_DEBUG_FAIL_FORWARD")


def debug_fail_on_token() -> int | None:
    """FERRUM_DEBUG_FAIL_ON_TOKEN=T: every engine core raises in each forward whose batch holds a
    request with token id T in its prompt (a poison request). A test-only fault hook; unset or
    < 0 disables it."""
    value = _get("FERRUM_DEBUG_FAIL_ON_TOKEN", "")
    try:
        token_id = int(value)
    except ValueError:
        return None
    return token_id if token_id >= 0 else None


def debug_no_pdl() -> bool:
    """FERRUM_DEBUG_NO_PDL=1: kernels launch without programmatic dependent launch (kernels/pdl.py),
    for A/B timing and for ruling it out when chasing a race."""
    return _get("FERRUM_DEBUG_NO_PDL", "0") == "1"


def debug_split_kv_fused_reduce() -> bool:
    """FERRUM_DEBUG_SPLIT_KV_FUSED_REDUCE=1: split-KV decode attention combines its parts inside
    the split kernel (the last part to finish) instead of a second kernel
    (kernels/split_kv_combine.py), for the A/B that decides the default."""
    return _get("FERRUM_DEBUG_SPLIT_KV_FUSED_REDUCE", "0") == "1"


def _positive_int(name: str) -> int | None:
    try:
        n = int(_get(name, ""))
    except ValueError:
        return None
    return n if n > 0 else None


def debug_profile_steps() -> tuple[int, int, str] | None:
    """FERRUM_DEBUG_PROFILE_STEPS=FIRST:COUNT:DIR: every tensor-parallel worker records a torch
    profile of steps FIRST .. FIRST+COUNT-1 (1-based, counted as the worker completes them) and
    writes its kernel table and a JSON summary to DIR/rank<r>.*. Unset or malformed disables it."""
    first, _, rest = _get("FERRUM_DEBUG_PROFILE_STEPS", "").partition(":")
    count, _, directory = rest.partition(":")
    try:
        window = (int(first), int(count))
    except ValueError:
        return None
    if window[0] < 1 or window[1] < 1 or not directory:
        return None
    return window[0], window[1], directory


def debug_ignore_tuned_tables() -> bool:
    """FERRUM_DEBUG_IGNORE_TUNED_TABLES=1: the kernels read no tuned tile table (neither the
    user's nor the packaged ones) and run the default rules' tiles: the untuned side of an A/B."""
    return _get("FERRUM_DEBUG_IGNORE_TUNED_TABLES", "0") == "1"


def tuned_config_dir() -> Path:
    """The folder of this machine's tuned tile tables (`ferrum tune` writes, kernels read) when
    no `tuned_config_dir` field names one: FERRUM_TUNED_CONFIG_DIR (for debugging), else
    $XDG_CACHE_HOME/ferrum/tuned_configs, else ~/.cache/ferrum/tuned_configs."""
    override = _get("FERRUM_TUNED_CONFIG_DIR", "")
    if override:
        return Path(override).expanduser()
    return _cache_root() / "tuned_configs"


def _cache_root() -> Path:
    """$XDG_CACHE_HOME/ferrum, else ~/.cache/ferrum."""
    cache = _get("XDG_CACHE_HOME", "")
    return (Path(cache) if cache else Path.home() / ".cache") / "ferrum"


def persist_flash_attn4_kernels() -> None:
    """Unless the environment says otherwise, FlashAttention-4 keeps the kernels it compiles on
    disk (FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1, in <cache>/ferrum/flash_attn4), so a later
    start-up loads them instead of compiling (H200: 0.01 s against 3.6 s a layer shape).
    flash_attn.cute reads both when it first loads: call before importing it."""
    if "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED" not in os.environ:
        os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] = "1"
        folder = str(_cache_root() / "flash_attn4")
        os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", folder)


def ray_address() -> str | None:
    """RAY_ADDRESS: the Ray cluster `ray.init()` joins (None: none set)."""
    return os.environ.get("RAY_ADDRESS")


def set_variable(name: str, value: str | None) -> None:
    """Sets `name` for this process and the processes it starts (None: unsets it)."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def child_environment(**extra: str) -> dict[str, str]:
    """This process's environment with `extra` set: what a child process is started with."""
    return {**os.environ, **extra}


def prefer_passive_openmp() -> None:
    """OMP_WAIT_POLICY=PASSIVE unless set, before torch loads OpenMP (which reads it once): idle
    CPU threads sleep instead of spinning, so steps on cores other work shares are not held up by
    spinning threads (benchmarks/RESULTS.md: several times faster there; the same when idle). Too
    late once torch is imported: then left alone (`openmp_spins` tells)."""
    if "OMP_WAIT_POLICY" not in os.environ and "torch" not in sys.modules:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def openmp_spins() -> bool:
    """Whether torch's OpenMP threads spin while idle: OMP_WAIT_POLICY is not PASSIVE."""
    return os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE"


def debug_slow_forward() -> float:
    """FERRUM_DEBUG_SLOW_FORWARD=S: every non-empty forward of an engine core first keeps the CPU
    busy for S seconds (a test-only stand-in for a slow step on busy cores); 0 when unset."""
    try:
        seconds = float(_get("FERRUM_DEBUG_SLOW_FORWARD", "0"))
    except ValueError:
        return 0.0
    return max(seconds, 0.0)
