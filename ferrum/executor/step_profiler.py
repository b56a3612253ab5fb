"""A debugging aid: a torch profile of a window of one worker's steps (FERRUM_DEBUG_PROFILE_STEPS).

It answers "where does a tensor-parallel step's device time go": the kernel table sorted by
device time, and the share of the collectives (NCCL and symmetric-memory kernels) in it.
"""

from __future__ import annotations

import json
import os

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from ferrum import envs
from ferrum.logger import init_logger

logger = init_logger(__name__)

# Kernel names of the collectives, as the CUDA profiler reports them.
_COLLECTIVE_MARKERS = ("nccl", "all_reduce", "allreduce", "all_gather", "allgather")


class StepProfiler:
    """Counts completed steps; profiles the configured window of them on this rank."""

    __slots__ = ("_rank", "_window", "_completed", "_profile")

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._window = envs.debug_profile_steps()
        self._completed = 0
        self._profile: profile | None = None

    def before_step(self) -> None:
        if self._window is None or self._profile is not None:
            return
        if self._completed + 1 == self._window[0]:
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self._profile = profile(activities=activities)
            self._profile.__enter__()

    def after_step(self) -> None:
        self._completed += 1
        if self._profile is None or self._window is None:
            return
        first, count, directory = self._window
        if self._completed < first + count - 1:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._profile.__exit__(None, None, None)
        self._write(directory, count)
        self._profile = None
        self._window = None

    def _write(self, directory: str, count: int) -> None:
        assert self._profile is not None
        events = self._profile.key_averages()
        os.makedirs(directory, exist_ok=True)
        stem = os.path.join(directory, f"rank{self._rank}")
        with open(f"{stem}.txt", "w", encoding="utf-8") as f:
            f.write(events.table(sort_by="self_device_time_total", row_limit=40))
        # Device rows only: an operator's self device time repeats its kernels' time.
        kernels = {
            e.key: e.self_device_time_total
            for e in events
            if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0
        }
        total = sum(kernels.values())
        collective = sum(
            t for name, t in kernels.items() if any(m in name.lower() for m in _COLLECTIVE_MARKERS)
        )
        summary = {
            "rank": self._rank,
            "steps": count,
            "device_us_per_step": total / count,
            "collective_us_per_step": collective / count,
            "collective_share": collective / total if total else 0.0,
        }
        with open(f"{stem}.json", "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
        logger.info("step profile of rank %d written to %s.*: %s", self._rank, stem, summary)
