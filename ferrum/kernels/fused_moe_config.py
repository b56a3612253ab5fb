"""Tile configs of the fused MoE kernels: `fused_moe_configs/E{E}_I{I}_H{H}[_fp8]_{device}.json`
maps batch buckets (the most tokens covered) to configs in up to three sections: "grouped"
(BLOCK_M/N/K, num_warps, num_stages; `tune_fused_moe.py --save`), "small" (GATE_UP_BLOCK_N/K,
DOWN_BLOCK_E (default 1), DOWN_SPLIT (default 0), DOWN_BLOCK_N/K, num_warps, num_stages;
`bench_moe_layer.py --sweep --save`, `ferrum tune`) and, in `_fp8` files, "grouped_w8a8" (the
grouped keys; W8A8 experts, `check_w8a8_config`; `ferrum tune --ops moe_w8a8`). A batch takes
the smallest bucket covering it, or the largest; a missing section falls back to the file
without `_fp8`; the user's folder (tuned_tables) is read before the package's. Without a file:
fused_moe_rule on a GPU, the fixed defaults below on the CPU."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from ferrum.kernels.tuned_tables import user_config_dir, write_table

CONFIG_DIR = Path(__file__).parent / "fused_moe_configs"
GROUPED_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
SMALL_KEYS = (
    "GATE_UP_BLOCK_N",
    "GATE_UP_BLOCK_K",
    "DOWN_BLOCK_E",
    "DOWN_SPLIT",
    "DOWN_BLOCK_N",
    "DOWN_BLOCK_K",
    "num_warps",
    "num_stages",
)
# The keys of each section a file may hold.
SECTION_KEYS = {"grouped": GROUPED_KEYS, "small": SMALL_KEYS, "grouped_w8a8": GROUPED_KEYS}
# The weight block (and activation group) of W8A8 experts: 128 columns of K, 128 rows of N.
W8A8_BLOCK = 128
# Keys a section may leave out, and their meaning then: files written before DOWN_BLOCK_E read one
# expert choice a down tile; before DOWN_SPLIT, one program summed all of a token's choices.
OPTIONAL_KEYS = {"DOWN_BLOCK_E": 1, "DOWN_SPLIT": 0}
# Keys that are switches, 0 or 1 (every other value is a positive integer).
FLAG_KEYS = ("DOWN_SPLIT",)
Buckets = dict[int, dict[str, int]]

# Defaults off CUDA (a GPU without a table takes fused_moe_rule's tiles).
# Small batches take narrow N tiles so that the few active experts still spread their weights
# over every SM.
DEFAULT_GROUPED: Buckets = {
    16: {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
    128: {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4},
    1024: {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    1 << 62: {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
}
# W8A8 grouped GEMMs off CUDA (the interpreter): one scale block a K step, one group a column tile.
DEFAULT_W8A8: Buckets = {
    1 << 62: {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2},
}
# Gate/up GEMV tile [GATE_UP_BLOCK_N rows of gate and of up, GATE_UP_BLOCK_K], down [DOWN_BLOCK_E
# choices, DOWN_BLOCK_N, DOWN_BLOCK_K]: 16-byte loads along K, several MB in flight a wave. One or
# two tokens have too few programs to hide a choice's wait on the one before: their tile spans them.
DEFAULT_SMALL: Buckets = {
    2: {
        "GATE_UP_BLOCK_N": 8,
        "GATE_UP_BLOCK_K": 256,
        "DOWN_BLOCK_E": 8,
        "DOWN_SPLIT": 0,
        "DOWN_BLOCK_N": 8,
        "DOWN_BLOCK_K": 128,
        "num_warps": 4,
        "num_stages": 2,
    },
    1 << 62: {
        "GATE_UP_BLOCK_N": 16,
        "GATE_UP_BLOCK_K": 256,
        "DOWN_BLOCK_E": 1,
        "DOWN_SPLIT": 0,
        "DOWN_BLOCK_N": 8,
        "DOWN_BLOCK_K": 1024,
        "num_warps": 4,
        "num_stages": 2,
    },
}


def config_path(
    num_experts: int, inter: int, hidden: int, device_name: str, fp8: bool = False
) -> Path:
    device = device_name.replace(" ", "_")
    weights = "_fp8" if fp8 else ""
    return CONFIG_DIR / f"E{num_experts}_I{inter}_H{hidden}{weights}_{device}.json"


def parse_buckets(section: object, keys: tuple[str, ...], where: str) -> Buckets:
    """Validates one section of a config file: {"<max tokens>": {key: int}}."""
    if not isinstance(section, dict) or not section:
        raise ValueError(f"{where}: must be a non-empty object of batch buckets")
    buckets: Buckets = {}
    for bound, config in section.items():
        if not str(bound).isdigit() or int(bound) < 1:
            raise ValueError(f"{where}: bucket {bound!r} must be a positive token count")
        if isinstance(config, dict):
            config = {k: v for k, v in OPTIONAL_KEYS.items() if k in keys} | config
        if not isinstance(config, dict) or set(config) != set(keys):
            raise ValueError(f"{where}[{bound}]: must have exactly the keys {list(keys)}")
        if not all(type(v) is int and v >= 1 for k, v in config.items() if k not in FLAG_KEYS):
            raise ValueError(f"{where}[{bound}]: values must be positive integers")
        if not all(
            config[k] in (0, 1) and type(config[k]) is int for k in FLAG_KEYS if k in config
        ):
            raise ValueError(f"{where}[{bound}]: {list(FLAG_KEYS)} must be 0 or 1")
        if config.get("DOWN_SPLIT") and config.get("DOWN_BLOCK_E", 1) != 1:
            raise ValueError(
                f"{where}[{bound}]: DOWN_SPLIT 1 runs one choice a program: DOWN_BLOCK_E must be "
                f"1, got {config['DOWN_BLOCK_E']}"
            )
        for key, value in config.items():
            if ("BLOCK" in key or key == "num_warps") and value & (value - 1):
                raise ValueError(f"{where}[{bound}]: {key} must be a power of two, got {value}")
            if key in ("BLOCK_M", "BLOCK_N", "BLOCK_K") and value < 16:
                raise ValueError(f"{where}[{bound}]: {key} must be >= 16 (tl.dot), got {value}")
        buckets[int(bound)] = dict(config)
    return dict(sorted(buckets.items()))


def check_w8a8_config(config: dict[str, int], where: str) -> None:
    """A W8A8 grouped config's own limits: BLOCK_N a power-of-two multiple of W8A8_BLOCK (the
    gate/up epilogue quantizes whole 128-column groups; tl.arange needs a power of two), BLOCK_K
    32, 64 or 128 (an e4m3 dot's K is at least 32; a K step reads one scale column)."""
    block_n = config["BLOCK_N"]
    if block_n % W8A8_BLOCK or block_n & (block_n - 1):
        raise ValueError(
            f"{where}: W8A8 BLOCK_N must be a multiple of {W8A8_BLOCK} and a power of two, got "
            f"{block_n}"
        )
    if config["BLOCK_K"] not in (32, 64, W8A8_BLOCK):
        raise ValueError(f"{where}: W8A8 BLOCK_K must be 32, 64 or 128, got {config['BLOCK_K']}")


def parse_section(section: str, data: object, where: str) -> Buckets:
    """One named section of a config file, validated (`SECTION_KEYS`, `check_w8a8_config`)."""
    buckets = parse_buckets(data, SECTION_KEYS[section], where)
    if section == "grouped_w8a8":
        for bound, config in buckets.items():
            check_w8a8_config(config, f"{where}[{bound}]")
    return buckets


@functools.cache
def load_tuned(
    num_experts: int,
    inter: int,
    hidden: int,
    device_name: str,
    fp8: bool = False,
    user_dir: Path | None = None,
) -> dict[str, Buckets]:
    """The sections of the matching tuned files, section by section `user_dir`'s (tuned_tables)
    over the package's ({} without either)."""
    name = config_path(num_experts, inter, hidden, device_name, fp8).name
    sections = _read_sections(CONFIG_DIR / name)
    if user_dir is not None:
        sections |= _read_sections(user_dir / CONFIG_DIR.name / name)
    return sections


def _read_sections(path: Path) -> dict[str, Buckets]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not set(data) <= set(SECTION_KEYS):
        raise ValueError(f"{path}: must be an object with sections {sorted(SECTION_KEYS)}")
    return {name: parse_section(name, data[name], f"{path}:{name}") for name in data}


def tuned_sections(
    num_experts: int, inter: int, hidden: int, device_name: str, fp8: bool = False
) -> dict[str, Buckets]:
    """Each section from the first file that has it: with fp8, the FP8 experts' files before
    the others; the process's user folder before the package within each."""
    user_dir = user_config_dir()
    tuned = load_tuned(num_experts, inter, hidden, device_name, False, user_dir)
    if fp8:
        tuned = tuned | load_tuned(num_experts, inter, hidden, device_name, True, user_dir)
    return tuned


def pick(buckets: Buckets, num_tokens: int) -> dict[str, int]:
    """The config of the smallest bucket covering num_tokens, else of the largest."""
    for bound, config in buckets.items():
        if num_tokens <= bound:
            return config
    return buckets[max(buckets)]


def get_configs(
    num_tokens: int,
    num_experts: int,
    inter: int,
    hidden: int,
    device_name: str | None,
    fp8: bool = False,
) -> tuple[dict[str, int], dict[str, int]]:
    """(grouped config, small-batch config) for a batch of num_tokens on the named device, of FP8
    experts or of experts in the activations' dtype."""
    tuned = tuned_sections(num_experts, inter, hidden, device_name, fp8) if device_name else {}
    return (
        pick(tuned.get("grouped", DEFAULT_GROUPED), num_tokens),
        pick(tuned.get("small", DEFAULT_SMALL), num_tokens),
    )


def save_section(
    num_experts: int,
    inter: int,
    hidden: int,
    device_name: str,
    section: str,
    buckets: Buckets,
    directory: Path | None = None,
    fp8: bool = False,
) -> Path:
    """Writes one section of the tuned file (of FP8 experts with fp8) in `directory` (default
    CONFIG_DIR), keeping the other sections."""
    if section not in SECTION_KEYS:
        raise ValueError(f"section must be one of {sorted(SECTION_KEYS)}, got {section!r}")
    if section == "grouped_w8a8" and not fp8:
        raise ValueError("section grouped_w8a8 belongs to the FP8 experts' file: pass fp8=True")
    parse_section(section, {str(k): v for k, v in buckets.items()}, section)
    directory = CONFIG_DIR if directory is None else directory
    path = directory / config_path(num_experts, inter, hidden, device_name, fp8).name
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[section] = {str(k): buckets[k] for k in sorted(buckets)}
    write_table(path, data)
    return path
