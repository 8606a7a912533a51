"""Advisory file locks (flock) that the kernel releases when their process dies.

filelock covers the exclusive, blocking lock around computing an entry; these
helpers cover what it does not: shared leases and non-blocking probes. Each
returns an open descriptor (the lock lives as long as it stays open) or None
where flock does not exist (then leases and sweeps are best effort).
"""
from __future__ import annotations

import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; callers treat None as "no lock"
    fcntl = None  # type: ignore[assignment]


def hold_shared(path: Path) -> int | None:
    """A shared lock, waiting for an exclusive holder (a `cache gc` removing the entry)."""
    return _lock(path, "LOCK_SH")


def hold_exclusive(path: Path) -> int | None:
    return _lock(path, "LOCK_EX")


def exclusive_nowait(path: Path) -> int | None:
    """An exclusive lock if nobody holds any lock on `path` now, else None."""
    if fcntl is None:
        return None
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    if not _still_linked(fd, path):
        os.close(fd)
        return None
    return fd


def release(fd: int) -> None:
    os.close(fd)  # closing the descriptor drops its flock


def _lock(path: Path, mode: str) -> int | None:
    if fcntl is None:
        return None
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, getattr(fcntl, mode))
        if _still_linked(fd, path):
            return fd
        os.close(fd)  # a sweeper removed the file between open and flock: lock the new one


def _still_linked(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False
