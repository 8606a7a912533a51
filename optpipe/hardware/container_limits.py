"""The memory and CPU time a container (a Linux control group) allows this process, beside the machine's.

Why it matters: in a container (`docker run --memory 8g --cpus 2`, a Kubernetes pod's limits, a CI
runner) /proc/meminfo and the CPU count describe the host. A memory preflight that read MemAvailable
let a model through that the kernel's OOM killer then ended halfway, with no line saying why; thread
counts set from the host's cores run into the CPU quota, whose throttling turns every latency figure
into noise. The cgroup's own files say what this process may use.

Why by hand: psutil reads the host's figures, not the cgroup's; the cgroup readers on PyPI are
unmaintained or only export metrics. The format is small and stable (the kernel's cgroup v1 and v2
documentation): the process's cgroup from /proc/self/cgroup, where each hierarchy is mounted from
/proc/self/mountinfo (a container sees its own cgroup at the mount's root), and the limit files, the
tightest along the path up to that root (a parent's limit holds its children).

Injectable for tests: every reader takes the /proc and mount paths it reads.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

#: cgroup v1's "no limit" (PAGE_COUNTER_MAX pages, rounded); anything this large is no limit.
_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class Mount:
    root: str  # the cgroup path mounted at `point` ("/" on the host; the container's own path when bound in)
    point: Path


@dataclass(frozen=True)
class ContainerLimits:
    memory_limit: int | None  # bytes; None: no limit below the machine's memory
    memory_used: int | None  # what the cgroup holds that the kernel cannot reclaim (its page cache left out)
    cpu_quota: float | None  # CPUs' worth of time per period; None: no quota

    def memory_available(self) -> int | None:
        if self.memory_limit is None:
            return None
        return max(0, self.memory_limit - (self.memory_used or 0))

    def cores(self) -> int | None:
        """Whole cores the quota pays for, rounded down: 2 threads on a quota of 1.5 CPUs run out of it 25 ms into
        every 100 ms period and wait for the next, and a latency caught in that wait is not the model's."""
        return None if self.cpu_quota is None else max(1, math.floor(self.cpu_quota + 1e-9))

    def record(self) -> dict:
        """What a report says: only the limits that are set."""
        out = {}
        if self.memory_limit is not None:
            out["memory_limit_bytes"] = self.memory_limit
        if self.cpu_quota is not None:
            out["cpu_quota"] = round(self.cpu_quota, 2)
        return out


def read_limits(proc: Path = Path("/proc/self")) -> ContainerLimits:
    """This process's cgroup limits; None for each that is not set or cannot be read (not Linux, no cgroup fs)."""
    try:
        paths = _cgroup_paths((proc / "cgroup").read_text())
        mounts = _mounts((proc / "mountinfo").read_text())
    except OSError:
        return ContainerLimits(None, None, None)
    memory = _memory(paths, mounts)
    return ContainerLimits(memory[0], memory[1], _cpu_quota(paths, mounts))


def _cgroup_paths(text: str) -> dict[str, str]:
    """controller -> cgroup path ("" for cgroup v2's unified hierarchy), from /proc/self/cgroup."""
    paths = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for name in controllers.split(",") if controllers else [""]:
            paths[name] = path
    return paths


def _mounts(text: str) -> dict[str, Mount]:
    """controller -> where its hierarchy is mounted ("" for the v2 one), from /proc/self/mountinfo."""
    mounts: dict[str, Mount] = {}
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        root, point, fstype, options = fields[3], Path(fields[4]), tail[0], tail[2].split(",")
        if fstype == "cgroup2":
            mounts.setdefault("", Mount(root, point))  # v2: one hierarchy
        elif fstype == "cgroup":
            for name in options:
                mounts.setdefault(name, Mount(root, point))  # v1: one per controller
    return mounts


def _chain(path: str, mount: Mount) -> list[Path]:
    """The cgroup's folder and its parents up to the mount point; the mount point alone where the path is not
    below the mount's root (a container whose own cgroup is bound at the root)."""
    rel = os.path.relpath(path or "/", mount.root) if (path or "/").startswith(mount.root) else "."
    here = mount.point / rel if not rel.startswith("..") else mount.point
    if not here.is_dir():
        here = mount.point
    chain = [here]
    while chain[-1] != mount.point and mount.point in chain[-1].parents:
        chain.append(chain[-1].parent)
    return chain


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _number(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        return None  # "max": no limit
    return value if value < _UNLIMITED else None


def _stat(folder: Path, key: str, file: str = "memory.stat") -> int | None:
    for line in (_read(folder / file) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return _number(value)
    return None


def _page_cache(folder: Path, prefix: str) -> int:
    """The cgroup's file pages: charged to its usage, but the kernel reclaims them before it kills anything (a
    model's files just read sit there as active pages: left in, a 1.1 GB model read once made 1.1 GB look used)."""
    return sum(_stat(folder, f"{prefix}{kind}_file") or 0 for kind in ("active", "inactive"))


def _folders(controller: str, paths: dict[str, str], mounts: dict[str, Mount]) -> tuple[list[Path], bool] | None:
    """The cgroup's folders for `controller` (its own, then its parents) and whether they are cgroup v1's: v1 where
    the controller has a hierarchy of its own (v1, or a hybrid whose v2 mount holds no such controller), else v2's."""
    if controller in mounts and controller in paths:
        return _chain(paths[controller], mounts[controller]), True
    if "" in mounts and "" in paths:
        return _chain(paths[""], mounts[""]), False
    return None


def _memory(paths: dict[str, str], mounts: dict[str, Mount]) -> tuple[int | None, int | None]:
    found = _folders("memory", paths, mounts)
    if found is None:
        return None, None
    chain, v1 = found
    if v1:
        limits = [_number(_read(folder / "memory.limit_in_bytes")) for folder in chain]
        limits.append(_stat(chain[0], "hierarchical_memory_limit"))
        usage, cache = _number(_read(chain[0] / "memory.usage_in_bytes")), _page_cache(chain[0], "total_")
    else:
        limits = [_number(_read(folder / "memory.max")) for folder in chain]
        usage, cache = _number(_read(chain[0] / "memory.current")), _page_cache(chain[0], "")
    set_limits = [limit for limit in limits if limit is not None]
    if not set_limits:
        return None, None
    used = None if usage is None else max(0, usage - cache)
    return min(set_limits), used


def _cpu_quota(paths: dict[str, str], mounts: dict[str, Mount]) -> float | None:
    found = _quota_folder(paths, mounts)
    return None if found is None else found[0]


def _quota_folder(paths: dict[str, str], mounts: dict[str, Mount]) -> tuple[float, Path, bool] | None:
    """The tightest quota up the hierarchy, in CPUs (v1's cfs_quota_us over cfs_period_us, -1: none; v2's cpu.max
    "quota period", "max": none), the folder that sets it and whether it is cgroup v1's."""
    found = _folders("cpu", paths, mounts)
    if found is None:
        return None
    chain, v1 = found
    if v1:
        pairs = [(_read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")) for folder in chain]
    else:
        pairs = [(_read(folder / "cpu.max") or "max").partition(" ")[::2] for folder in chain]
    quotas = [(int(quota) / int(period), folder, v1) for (quota, period), folder in zip(pairs, chain)
              if quota and period and quota.isdigit() and period.isdigit() and int(quota) > 0 and int(period) > 0]
    return min(quotas, key=lambda found: found[0], default=None)


def cpu_throttled_s(proc: Path = Path("/proc/self")) -> float | None:
    """Seconds the CPU quota has held this process's cgroup back so far (the throttled time in cpu.stat of the
    folder whose quota is the tightest, summed over its CPUs' run queues by the kernel); None without a quota.
    A difference of two readings is the time the timed calls waited for the next period, not ran."""
    try:
        found = _quota_folder(_cgroup_paths((proc / "cgroup").read_text()), _mounts((proc / "mountinfo").read_text()))
    except OSError:
        return None
    if found is None:
        return None
    _, folder, v1 = found
    key, unit = ("throttled_time", 1e-9) if v1 else ("throttled_usec", 1e-6)
    value = _stat(folder, key, "cpu.stat")
    return None if value is None else value * unit
