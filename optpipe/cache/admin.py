"""Looking after a cache: list its entries, prune them by age and size, verify their hashes.

The cache must carry optpipe's marker (optpipe.cache.folder); an entry is a child,
named by its key, of a top-level cache folder (`stages/<key>/`, `datasets/<key>/`,
`results/<key>.json`, or what another component stores the same way). Folder
entries carry a manifest of file hashes; results carry the hash of their value.
Pruning skips entries that a running compile holds (its lease) or computes (its lock).
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

from optpipe.core.artifact import MANIFEST_FILE
from optpipe.cache.folder import is_entry_name
from optpipe.cache.store import RESULTS, SERVICE_DIRS, discard, read_result, sweep_leftovers, verify_entry
from optpipe.core.errors import OptpipeError
from optpipe.cache.locking import exclusive_nowait, release

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_AGE_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


@dataclass
class CacheEntry:
    kind: str
    key: str
    path: Path
    size: int
    last_used: float
    label: str

    @property
    def age_s(self) -> float:
        return max(0.0, time.time() - self.last_used)


def list_entries(root: Path) -> list[CacheEntry]:
    """Every entry under `root`, most recently used first."""
    entries = []
    for kind in sorted(p for p in root.iterdir() if p.is_dir() and p.name not in SERVICE_DIRS) if root.exists() else []:
        for path in kind.iterdir():
            if not is_entry_name(path.name):
                continue  # a writer's temp file, or nothing optpipe published: never touched
            entries.append(CacheEntry(kind.name, path.name.removesuffix(".json"), path, _size(path), _mtime(path), _label(path)))
    return sorted(entries, key=lambda e: e.last_used, reverse=True)


def verify(entry: CacheEntry) -> str | None:
    """None when the entry matches its hashes, else what is wrong."""
    if entry.path.is_dir():
        return verify_entry(entry.path)
    if entry.path.suffix == ".json" and entry.kind == RESULTS:
        return read_result(entry.path)[1]
    # A file another component stores without a hash (ORT's calibration ranges, a TensorRT
    # timing cache): nothing to check against, so never reported corrupted nor deleted.
    return None


def remove(root: Path, entry: CacheEntry) -> bool:
    """Remove an entry unless a running process holds or computes it; True when removed."""
    lease = exclusive_nowait(root / "locks" / f"{entry.key}.use")
    if lease is None:
        return False
    try:
        compute = exclusive_nowait(root / "locks" / f"{entry.key}.lock")
        if compute is None:
            return False
        try:
            if entry.path.is_dir():
                discard(root, entry.path)
            else:
                entry.path.unlink(missing_ok=True)
        finally:
            release(compute)
    finally:
        release(lease)
    return True


@dataclass
class GcResult:
    removed: list[CacheEntry]
    busy: list[CacheEntry]
    kept_bytes: int
    leftovers: int


def collect_garbage(root: Path, older_than_s: float | None, max_bytes: int | None, dry_run: bool = False) -> GcResult:
    """Remove entries unused for `older_than_s`, then the least recently used until the cache fits `max_bytes`."""
    leftovers = 0 if dry_run or not root.exists() else len(sweep_leftovers(root))
    entries = list_entries(root)
    doomed = [e for e in entries if older_than_s is not None and e.age_s > older_than_s]
    total = sum(e.size for e in entries) - sum(e.size for e in doomed)
    if max_bytes is not None:
        for entry in reversed(entries):  # least recently used first
            if total <= max_bytes:
                break
            if entry not in doomed:
                doomed.append(entry)
                total -= entry.size
    removed, busy = [], []
    for entry in doomed:
        if dry_run or remove(root, entry):
            removed.append(entry)
        else:
            busy.append(entry)
    kept = sum(e.size for e in entries) - sum(e.size for e in removed)
    return GcResult(removed, busy, kept, leftovers)


def parse_size(text: str) -> int:
    match = _SIZE.match(text)
    if not match:
        raise OptpipeError(f"--max-size: '{text}' is not a size; write e.g. 500M or 20G")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def parse_age(text: str) -> float:
    match = _AGE.match(text)
    if not match:
        raise OptpipeError(f"--older-than: '{text}' is not an age; write e.g. 12h, 7d or 2w")
    return float(match.group(1)) * _AGE_UNITS[match.group(2).lower()]


def human_size(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size} B"


def human_age(seconds: float) -> str:
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= length:
            return f"{seconds / length:.0f}{unit}"
    return f"{seconds:.0f}s"


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _label(path: Path) -> str:
    """What made the entry, from its manifest: the stage and pass, or the data source."""
    if not path.is_dir():
        return "evaluation" if path.parent.name == "results" else ""
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return "(no manifest)"
    if "pass" in manifest:
        return f"{manifest.get('recipe', '?')}/{manifest.get('stage', '?')} ({manifest['pass']})"
    if "source" in manifest:
        return f"{manifest['source']}, {manifest.get('samples', '?')} samples"
    return ""


__all__ = ["CacheEntry", "list_entries", "verify", "collect_garbage", "parse_size", "parse_age"]
