"""Whether a core process is working, as the operating system sees it (Linux /proc; None or False
elsewhere): the CPU time it and its worker processes used, which a slow step on the CPU keeps
spending and a stalled or stopped core does not, and whether it is stopped (SIGSTOP)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (the state first), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def cpu_seconds(pids: Iterable[int]) -> list[float] | None:
    """User + system CPU seconds each process used so far (a gone one: 0); None without /proc."""
    if not Path("/proc/self/stat").exists():
        return None
    seconds = []
    for pid in pids:
        fields = _stat(pid)
        ticks = 0 if fields is None else int(fields[11]) + int(fields[12])  # utime, stime
        seconds.append(ticks / _CLOCK_TICKS)
    return seconds


def is_stopped(pid: int) -> bool:
    """Whether the process is stopped by a signal (SIGSTOP; a debugger's stop is not counted)."""
    fields = _stat(pid)
    return fields is not None and fields[0] == "T"
