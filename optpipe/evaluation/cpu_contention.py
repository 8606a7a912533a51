"""How much of this process's CPUs other processes took while a figure was timed.

The timing's own shape (p90/p50, run-to-run spread) misses a slowdown that is steady: PyTorch
eager, its threads sharing two cores with another job, ran a steady 38x slower (spread 1%) and
every speed-up against it read 38x too high. What the rest of the machine did is read from the
kernel instead: the busy time of the CPUs this process may run on (/proc/stat), less this
process's own CPU time (os.times: all its threads, ONNX Runtime's, OpenVINO's and PyTorch's
included), over the wall time those CPUs offered.

No library reports this per process set (psutil would read the same /proc files, and is not a
dependency); Linux only: elsewhere the figure is None and only the timing's shape judges.

In a container with a CPU quota the host's /proc/stat does not show the other kind of wait: the
quota spent, this process's threads stopped until the next period (idle CPUs, to the host). The
cgroup's throttled time says how long (optpipe.hardware.container_limits.cpu_throttled_s).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

from optpipe.hardware.container_limits import cpu_throttled_s

#: Shorter spans are not judged: /proc/stat counts in clock ticks (10 ms), too coarse below this.
MIN_WALL_S = 0.5


@dataclass(frozen=True)
class CpuSnapshot:
    wall_s: float
    busy_s: float  # busy time of the CPUs in this process's affinity set, every process's
    own_s: float  # this process's user + system time, all threads
    cpus: int
    throttled_s: Optional[float] = None  # the cgroup's throttled time so far; None without a CPU quota


def snapshot() -> Optional[CpuSnapshot]:
    """Now, or None where /proc/stat cannot be read."""
    try:
        allowed = os.sched_getaffinity(0)
        with open("/proc/stat", encoding="ascii") as stat:
            lines = stat.read().splitlines()
        tick = os.sysconf("SC_CLK_TCK")
    except (AttributeError, OSError, ValueError):
        return None
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in allowed):
            continue
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
        busy += user + nice + system + irq + softirq + steal  # steal: another VM had the core
    times = os.times()
    return CpuSnapshot(time.monotonic(), busy / tick, times.user + times.system, len(allowed), cpu_throttled_s())


def others_share(start: Optional[CpuSnapshot], end: Optional[CpuSnapshot]) -> Optional[float]:
    """The share (0..1) of this process's CPUs that other processes used between two snapshots."""
    if start is None or end is None or end.wall_s - start.wall_s < MIN_WALL_S:
        return None
    others = (end.busy_s - start.busy_s) - (end.own_s - start.own_s)
    return round(min(1.0, max(0.0, others / ((end.wall_s - start.wall_s) * end.cpus))), 3)


def shares(start: Optional[CpuSnapshot], end: Optional[CpuSnapshot]) -> tuple[Optional[float], Optional[float]]:
    """(other processes' share, the container quota's held-back share) between two snapshots: what a figure's busy
    check reads (optpipe.evaluation.latency.busy_reason)."""
    return others_share(start, end), throttled_share(start, end)


def throttled_share(start: Optional[CpuSnapshot], end: Optional[CpuSnapshot]) -> Optional[float]:
    """The share (0..1) of this process's CPU time the container's quota held it back between two snapshots
    (the kernel sums the throttled time over the CPUs' run queues: divided by the CPUs' wall time); None
    without a quota or when too short to tell."""
    if start is None or end is None or start.throttled_s is None or end.throttled_s is None \
            or end.wall_s - start.wall_s < MIN_WALL_S:
        return None
    waited = max(0.0, end.throttled_s - start.throttled_s)
    return round(min(1.0, waited / ((end.wall_s - start.wall_s) * end.cpus)), 3)
