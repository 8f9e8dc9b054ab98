"""Checks on the processes a test's subject starts (TP workers, DP replicas): alive, found, gone."""
from __future__ import annotations

import os
import time


def alive(pid: int) -> bool:
    """Whether pid runs: a zombie has exited (only its parent's reaper is missing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def children_of(pid: int) -> list[int]:
    """The live child processes of pid, less multiprocessing's resource tracker (which ends by itself
    once its parent has exited)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                tracker = b"resource_tracker" in f.read()
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid and not tracker and alive(int(entry)):
            found.append(int(entry))
    return found


def still_alive_after(pids: list[int], seconds: float = 30) -> list[int]:
    """Those of pids still running once they have all ended or `seconds` have passed."""
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]
