"""How many threads torch's CPU ops run on, so that a machine shared with other busy processes slows a
job down in proportion, not tenfold.

torch splits each product evenly over its intra-op (OpenMP) threads and waits at the end for the
slowest. A thread that shares its core with another busy process gets part of that core, and the
threads that wait for it spin (OpenMP's default wait policy busy-waits before it sleeps), taking CPU
time from the very thread they wait for. So the engine runs on the cores this process may use
(os.sched_getaffinity) less those that other processes keep busy, measured from /proc/stat every
INTERVAL_S between steps: one thread fewer for each core that others use more than half of.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

INTERVAL_S = 0.5  # how often the load of other processes is measured
STALE_S = 4 * INTERVAL_S  # a window longer than this (the engine was idle) is not judged: it is restarted
TAKEN = 0.5  # a core that other processes keep busy more than this share of the time is theirs
IDLE_FIELDS = (3, 4)  # idle, iowait: /proc/stat's fields after the cpu name (user nice system idle iowait ...)


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


@dataclass
class CpuSample:
    """Busy and total time of the usable cores (in clock ticks, from /proc/stat), and this process's
    own CPU time (in seconds, all its threads)."""

    busy: int
    total: int
    own_s: float


def parse_proc_stat(text: str, cores: set[int]) -> tuple[int, int]:
    """(busy ticks, total ticks) of the cores in `cores`, summed, from /proc/stat's text."""
    busy = total = 0
    for line in text.splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cores:
            continue
        ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
        total += sum(ticks)
        busy += sum(ticks) - sum(ticks[i] for i in IDLE_FIELDS)
    return busy, total


def cores_busy_elsewhere(before: CpuSample, after: CpuSample, num_cores: int, ticks_per_s: float) -> float:
    """How many of the usable cores other processes kept busy between two samples (0 .. num_cores)."""
    elapsed = (after.total - before.total) / ticks_per_s / num_cores  # seconds, per core
    if elapsed <= 0:
        return 0.0
    others = (after.busy - before.busy) / ticks_per_s - (after.own_s - before.own_s)
    return min(max(others / elapsed, 0.0), float(num_cores))


def threads_for(num_cores: int, busy_elsewhere: float) -> int:
    """One thread per usable core, less one for each core that other processes hold."""
    taken = int(busy_elsewhere + (1 - TAKEN))  # (rounds at TAKEN)
    return min(max(num_cores - taken, 1), num_cores)


class CpuThreads:
    """Sets torch's thread count: `fixed` threads, or (None) the automatic choice above, adjusted by
    `adjust()` between steps. torch's thread count is the process's: two engines in one process share it."""

    def __init__(self, fixed: int | None, num_cores: int | None = None):
        self.fixed = fixed
        self.num_cores = num_cores or usable_cores()
        self.threads = fixed or self.num_cores
        self._cores = self._core_ids()
        self._ticks_per_s = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._sample: CpuSample | None = None
        self._sampled_at = 0.0
        torch.set_num_threads(self.threads)
        if fixed is None:
            self._take_sample(time.monotonic())

    @property
    def automatic(self) -> bool:
        return self.fixed is None and self._cores is not None

    def _core_ids(self) -> set[int] | None:
        """The usable cores' ids, or None where /proc/stat cannot be read (not Linux): no adjusting."""
        try:
            cores = os.sched_getaffinity(0)
            with open("/proc/stat") as f:
                f.read(1)
            return cores
        except (AttributeError, OSError):
            return None

    def _read(self) -> CpuSample | None:
        try:
            with open("/proc/stat") as f:
                text = f.read()
        except OSError:
            return None
        times = os.times()
        return CpuSample(*parse_proc_stat(text, self._cores), own_s=times.user + times.system)

    def _take_sample(self, now: float) -> CpuSample | None:
        before, self._sample, self._sampled_at = self._sample, self._read(), now
        return before

    def adjust(self) -> None:
        """Between steps: every INTERVAL_S, measure what other processes used and set the thread count."""
        if not self.automatic:
            return
        now = time.monotonic()
        if now - self._sampled_at < INTERVAL_S:
            return
        fresh = now - self._sampled_at <= STALE_S
        before = self._take_sample(now)
        if not fresh or before is None or self._sample is None:
            return
        busy = cores_busy_elsewhere(before, self._sample, self.num_cores, self._ticks_per_s)
        threads = threads_for(self.num_cores, busy)
        if threads != self.threads:
            self.threads = threads
            torch.set_num_threads(threads)
