"""What the tile rules know of a GPU: a plain `DeviceProperties`, read once per device from
torch.cuda.get_device_properties (`device_properties`), or one of KNOWN_DEVICES, the GPUs ferrum is
described against (CPU tests pass these as fake devices). HBM bandwidth is not a CUDA property:
it is computed from the memory clock and bus width where torch reports them (double data rate),
else taken from KNOWN_DEVICES by name, else estimated from the SM count."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

KIB = 1024
MIB = 1024 * KIB


@dataclass(frozen=True, slots=True)
class DeviceProperties:
    """One GPU as the tile rules see it. `shared_memory_per_block` is the opt-in maximum one
    program may use (bytes); `hbm_bandwidth` in bytes per second."""

    name: str
    num_sms: int
    shared_memory_per_block: int
    capability: tuple[int, int]
    l2_cache_bytes: int
    hbm_bandwidth: float

    def __post_init__(self) -> None:
        if self.num_sms < 1:
            raise ValueError(f"num_sms must be >= 1, got {self.num_sms}")
        if self.shared_memory_per_block < 16 * KIB:
            raise ValueError(
                f"shared_memory_per_block must be >= {16 * KIB} bytes, got "
                f"{self.shared_memory_per_block}"
            )

    @property
    def table_name(self) -> str:
        """The name as tuned-table files spell it (spaces as underscores)."""
        return self.name.replace(" ", "_")

    @property
    def is_hopper(self) -> bool:
        """sm90: wgmma tensor cores, TMA, and cuBLASLt's block-scaled FP8 GEMM."""
        return self.capability == (9, 0)

    @property
    def has_fp8_tensor_cores(self) -> bool:
        """sm89 and newer multiply e4m3 on tensor cores."""
        return self.capability >= (8, 9)


def _device(
    name: str, sms: int, smem_kib: int, cc: tuple[int, int], l2_mib: int, tb_s: float
) -> DeviceProperties:
    return DeviceProperties(name, sms, smem_kib * KIB, cc, l2_mib * MIB, tb_s * 1e12)


# Datasheet figures; the names are torch.cuda.get_device_name's.
H100 = _device("NVIDIA H100 80GB HBM3", 132, 227, (9, 0), 50, 3.35)
H200 = _device("NVIDIA H200", 132, 227, (9, 0), 50, 4.8)
A100 = _device("NVIDIA A100-SXM4-80GB", 108, 163, (8, 0), 40, 2.04)
L40S = _device("NVIDIA L40S", 142, 99, (8, 9), 96, 0.864)
RTX_4090 = _device("NVIDIA GeForce RTX 4090", 128, 99, (8, 9), 72, 1.008)
B200 = _device("NVIDIA B200", 148, 227, (10, 0), 126, 8.0)
KNOWN_DEVICES = {d.name: d for d in (H100, H200, A100, L40S, RTX_4090, B200)}
# Bytes per second per SM where neither torch nor KNOWN_DEVICES tells (an H100's share).
_BANDWIDTH_PER_SM = 3.35e12 / 132


def _bandwidth(props: object, name: str, num_sms: int) -> float:
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    if clock_khz and bus_bits:
        return 2.0 * clock_khz * 1e3 * bus_bits / 8
    if name in KNOWN_DEVICES:
        return KNOWN_DEVICES[name].hbm_bandwidth
    return _BANDWIDTH_PER_SM * num_sms


@functools.cache
def device_properties(device: torch.device) -> DeviceProperties | None:
    """The properties of a CUDA device (cached per device); None off CUDA."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    name = props.name
    known = KNOWN_DEVICES.get(name)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or (
        known.shared_memory_per_block if known else 48 * KIB
    )
    l2 = getattr(props, "L2_cache_size", 0) or (known.l2_cache_bytes if known else 0)
    return DeviceProperties(
        name=name,
        num_sms=props.multi_processor_count,
        shared_memory_per_block=smem,
        capability=(props.major, props.minor),
        l2_cache_bytes=l2,
        hbm_bandwidth=_bandwidth(props, name, props.multi_processor_count),
    )
