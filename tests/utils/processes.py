"""Process checks for the tests of worker processes, from /proc (Linux): who descends from a
process, whether a pid still runs (a zombie counts as gone: it runs nothing), bounded waits."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may hold spaces; it ends at the last ')'.
    return text[text.rindex(")") + 2 :].split()


def is_running(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def descendant_pids(pid: int) -> list[int]:
    """Every running process below `pid` (children, their children...)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(int(entry))) is not None:
            parents[int(entry)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent]
        found += children
        frontier += children
    return sorted(p for p in found if is_running(p))


def worker_pids(pid: int) -> list[int]:
    """The tensor-parallel worker processes below `pid`."""
    return [p for p in descendant_pids(pid) if b"ferrum.executor.worker" in _cmdline(p)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Polls `condition()` until true; raises TimeoutError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(0.05)


def wait_gone(pids: list[int], timeout: float = 30.0) -> None:
    wait_until(lambda: not any(map(is_running, pids)), timeout, f"processes {pids} exited")
