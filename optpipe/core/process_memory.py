"""Giving freed memory back to the operating system between a compile's stages.

Why: glibc's malloc keeps the pages of freed blocks in the process (its arenas) for reuse; after a
pass that copied a model several times (onnxslim, ORT's fusers and quantizers free all of it on
return), the process kept that memory as RSS into the next stage, which then peaked on top of it.
Measured on BERT-base (438 MB): after onnxslim and the deletion of every model, RSS stayed at
2.0 GB; `malloc_trim(0)` took it to 0.56 GB (docs/memory.md). `malloc_trim` is glibc's public API
for exactly this; elsewhere (musl, macOS, Windows) this is a no-op.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return getattr(libc, "malloc_trim", None)
    except OSError:
        return None


#: Grown less than this since the last hand-back, there is too little to give back to pay for it:
#: gc.collect plus malloc_trim cost ~0.1 s with torch, ORT and OpenVINO loaded (measured), which the
#: suite's ~2000 stage and evaluation boundaries on tiny models paid for nothing (minutes of CI).
WORTH_RELEASING = 64 * 2**20
_rss_after_release = 0


def release_freed_memory(force: bool = False) -> bool:
    """Collect Python's garbage, then hand the allocator's free pages back, when the process grew by
    WORTH_RELEASING since it last did (or `force`); True when it did. False where the C library has no
    malloc_trim."""
    global _rss_after_release
    trim = _malloc_trim()
    if trim is None:
        return False
    if not force and _resident_bytes() - _rss_after_release < WORTH_RELEASING:
        return False
    gc.collect()
    trim(0)
    _rss_after_release = _resident_bytes()
    return True


def _resident_bytes() -> int:
    """This process's resident set (Linux /proc/self/statm; 0 elsewhere: then every call releases)."""
    import os

    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
