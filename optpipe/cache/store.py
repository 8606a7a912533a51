"""The content-addressed cache: stage outputs, sample sets and evaluation results.

A folder entry (a stage's model, a sample set) lives under `<kind>/<key>/`, where
the key hashes everything the output depends on (input model, pass name and
version, params, data, library versions). It is written in a private workdir and
published with one rename, with a manifest of file hashes written last: a reader
sees a whole entry or none, also when the writer is killed at any moment. A hit
is re-hashed against its manifest; a corrupted entry is dropped with a warning
and recomputed. A small JSON result carries the hash of its value the same way.

Processes sharing a cache coordinate through three kinds of lock, all released
by the kernel when a process dies (so a SIGKILL never leaves one held):
- a per-key lock (`locks/<key>.lock`), held while an entry is computed, so a
  second process waits and then reuses it rather than computing it twice;
- a per-workdir lock (`tmp/<name>.lock`), held while a workdir is written, so
  leftovers of killed runs are swept and live workdirs are not;
- a shared lease per entry in use (`locks/<key>.use`), so `cache gc` never
  removes an entry a running compile reads.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import time
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

from filelock import FileLock

from optpipe.core.artifact import INFO_FILE, MANIFEST_FILE, ModelArtifact, content_hash, sha256_file, sha256_json, write_text_atomic
from optpipe.cache.folder import SERVICE_DIRS, CacheFolderError, prepare_cache_folder
from optpipe.cache.locking import exclusive_nowait, hold_exclusive, hold_shared, release
from optpipe.cache.manifest import UntrustedEntry, check_name, checked_files, checked_sizes

MANIFEST = MANIFEST_FILE
STAGES = "stages"
RESULTS = "results"
# Temp files of a killed writer (atomic JSON and npz writes) older than this are swept.
STALE_TEMP_S = 3600.0
WORKDIR_NAME_LEN = len("work-") + 32  # work-<uuid4 hex>; files beside a workdir share the prefix
log = logging.getLogger("optpipe.cache.store")
# Leases this process holds, shared by every StageCache on the same root; released at exit.
_LEASES: dict[Path, int] = {}


def default_cache_dir() -> Path:
    # An empty OPTPIPE_CACHE means the default (it used to mean the working directory).
    return Path(os.environ.get("OPTPIPE_CACHE") or Path.home() / ".cache" / "optpipe").expanduser()


def library_versions(names: tuple[str, ...]) -> dict[str, str]:
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


class StageCache:
    def __init__(self, root: Path):
        self.root = root
        prepare_cache_folder(root)
        for sub in (STAGES, RESULTS, *SERVICE_DIRS):
            if (root / sub).exists() and not (root / sub).is_dir():
                raise CacheFolderError(f"cache folder '{root}': '{sub}' is a file, not a folder; remove it (the cache rebuilds it)")
            (root / sub).mkdir(parents=True, exist_ok=True)
        self._workdir_locks: dict[Path, int] = {}
        sweep_leftovers(self.root)

    @staticmethod
    def key(**parts: Any) -> str:
        return sha256_json(parts)

    def entry_dir(self, key: str, kind: str = STAGES) -> Path:
        return self.root / kind / key

    def lock(self, key: str) -> FileLock:
        """Held while computing the entry `key`: a second process waits, then finds it published."""
        return FileLock(str(self.root / "locks" / f"{key}.lock"))

    def lease(self, key: str) -> None:
        """Mark the entry `key` in use by this process until it ends, so `cache gc` leaves it alone."""
        path = self.root / "locks" / f"{key}.use"
        if path not in _LEASES:
            fd = hold_shared(path)
            if fd is not None:
                _LEASES[path] = fd

    def release_leases(self) -> None:
        """Drop this process's leases on entries of this cache (a compile does when it ends)."""
        for path in [p for p in _LEASES if p.parent == self.root / "locks"]:
            release(_LEASES.pop(path))

    def new_workdir(self) -> Path:
        """A private folder to build an entry in; locked so a sweep by another process skips it."""
        name = f"work-{uuid.uuid4().hex}"
        fd = hold_exclusive(self.root / "tmp" / f"{name}.lock")
        workdir = self.root / "tmp" / name
        workdir.mkdir()
        if fd is not None:
            self._workdir_locks[workdir] = fd
        return workdir

    def release_workdir(self, workdir: Path) -> None:
        """Remove a workdir (gone already once published), the files beside it that were its stage's
        (`<workdir>.<suffix>`: what a pass handed to the self-check, a worker's request), and drop its lock."""
        shutil.rmtree(workdir, ignore_errors=True)
        for beside in workdir.parent.glob(workdir.name + ".*"):
            if beside.suffix != ".lock" and beside.is_file():
                beside.unlink(missing_ok=True)
        fd = self._workdir_locks.pop(workdir, None)
        if fd is not None:
            (self.root / "tmp" / f"{workdir.name}.lock").unlink(missing_ok=True)
            release(fd)

    # Folder entries (stage models, sample sets).
    def lookup(self, key: str) -> ModelArtifact | None:
        """The verified stage entry for `key`, or None (a corrupted entry is removed)."""
        folder = self.lookup_folder(key, STAGES)
        return ModelArtifact.open(folder) if folder else None

    def lookup_folder(self, key: str, kind: str) -> Path | None:
        folder = self.entry_dir(key, kind)
        self.lease(key)  # first: a `cache gc` removing it now finishes before the check below
        if not folder.exists():
            return None
        problem = verify_entry(folder)
        if problem:
            log.warning("cache entry %s/%s is corrupted (%s); recomputing it", kind, key[:12], problem)
            self.discard(folder)
            return None
        _touch(folder)
        return folder

    def publish(self, key: str, workdir: Path, meta: dict[str, Any] | None = None) -> ModelArtifact:
        """Move a finished workdir into the cache under `key`, atomically."""
        return ModelArtifact.open(self.publish_folder(key, workdir, STAGES, meta))

    def publish_folder(self, key: str, workdir: Path, kind: str, meta: dict[str, Any] | None = None) -> Path:
        write_manifest(workdir, {"key": key, "kind": kind, "created": time.time(), **(meta or {})})
        target = self.entry_dir(key, kind)
        target.parent.mkdir(parents=True, exist_ok=True)
        self.lease(key)
        try:
            os.rename(workdir, target)
        except OSError:
            # Another process published the same key first: its entry is equivalent, keep it.
            shutil.rmtree(workdir, ignore_errors=True)
        return target

    def discard(self, folder: Path) -> None:
        discard(self.root, folder)

    # Small JSON results (evaluations), keyed the same way, each carrying the hash of its value.
    def result_path(self, key: str) -> Path:
        return self.root / RESULTS / f"{key}.json"

    def get_result(self, key: str) -> dict | None:
        path = self.result_path(key)
        self.lease(key)
        if not path.exists():
            return None
        value, problem = read_result(path)
        if problem:
            log.warning("cache result %s is corrupted (%s); recomputing it", key[:12], problem)
            path.unlink(missing_ok=True)
            return None
        _touch(path)
        return value

    def put_result(self, key: str, value: dict) -> None:
        self.lease(key)
        _write_json_atomic(self.result_path(key), {"sha256": sha256_json(value), "value": value})


class LeaseSet:
    """Leases held apart from the per-run ones (StageCache.release_leases, which every task calls
    when it ends, leaves these): a driver keeps each stage its later tasks read (a search's
    shared prefix, a parent evaluated after its child ran) until the whole run ends."""

    def __init__(self, root: Path):
        self.root = root
        self._fds: dict[Path, int] = {}

    def hold(self, key: str) -> None:
        path = self.root / "locks" / f"{key}.use"
        if path not in self._fds and path.parent.is_dir():
            fd = hold_shared(path)
            if fd is not None:
                self._fds[path] = fd

    def close(self) -> None:
        for fd in self._fds.values():
            release(fd)
        self._fds.clear()


def discard(root: Path, folder: Path) -> None:
    """Remove an entry folder: first renamed out of sight (atomic), then deleted."""
    trash = root / "tmp" / f"trash-{uuid.uuid4().hex}"
    try:
        os.rename(folder, trash)
    except OSError:
        return
    if trash.is_dir() and not trash.is_symlink():
        shutil.rmtree(trash, ignore_errors=True)
    else:
        trash.unlink(missing_ok=True)  # a file or a link where an entry folder belongs: only it goes


def write_manifest(folder: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Hash every file of `folder` into its manifest (written last, atomically) and return it.

    Names a reader would refuse (optpipe.cache.manifest) are refused here, so that no entry
    optpipe publishes is rejected by the next lookup and recomputed forever."""
    paths = sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST)
    files = {check_name(p.name): sha256_file(p) for p in paths}
    sizes = {p.name: p.stat().st_size for p in paths}
    manifest = {**meta, "files": files, "sizes": sizes, "content": content_hash(files)}
    _write_json_atomic(folder / MANIFEST, manifest)
    return manifest


def verify_entry(folder: Path) -> str | None:
    """None when every file matches the manifest; else what is wrong.

    The manifest is untrusted (optpipe.cache.manifest): its names are checked before any is
    opened, and a symlink (or anything but a plain file) in the entry is refused, so a hit
    never reads, nor copies into a run folder, a file outside the entry."""
    if folder.is_symlink():
        return "the entry is a link, not a folder of the cache"
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return "no readable manifest"
    try:
        expected = checked_files(manifest)
        sizes = checked_sizes(manifest, expected)
    except UntrustedEntry as exc:
        return str(exc)
    present = set()
    for child in folder.iterdir():
        mode = child.lstat().st_mode
        if stat.S_ISLNK(mode) or not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            return f"{child.name} is a link or a special file, not a plain file"
        if stat.S_ISREG(mode) and child.name != MANIFEST:
            present.add(child.name)
    if present != set(expected):
        return f"files differ from the manifest: {sorted(present ^ set(expected))}"
    for name, digest in expected.items():
        if "sizes" in manifest and (folder / name).stat().st_size != sizes[name]:
            return f"{name} does not match its hash (its size differs from the manifest)"
        if sha256_file(folder / name) != digest:
            return f"{name} does not match its hash"
    if manifest.get("content") != content_hash(expected):
        return "the manifest's content hash does not match its files"
    return None


def read_result(path: Path) -> tuple[dict | None, str | None]:
    """A result's value and None, or None and what is wrong with it."""
    try:
        if not stat.S_ISREG(path.lstat().st_mode):
            return None, "a link or a special file, not a plain file"
        wrapped = json.loads(path.read_text())
        value, digest = wrapped["value"], wrapped["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None, "not a readable result"
    if not isinstance(value, dict):
        return None, "its value is not a JSON object"
    if sha256_json(value) != digest:
        return None, "its value does not match its hash"
    return value, None


def sweep_leftovers(root: Path) -> list[Path]:
    """Remove what killed writers left in the cache: unlocked workdirs, trash, old temp files.

    A workdir whose lock another process holds is being written and is left alone.
    """
    removed = []
    tmp = root / "tmp"
    owners = {path.name[:WORKDIR_NAME_LEN] for path in tmp.glob("work-*")} if tmp.exists() else set()
    for owner in owners:
        lock = tmp / f"{owner}.lock"
        fd = exclusive_nowait(lock)
        if fd is None:
            continue  # a live process owns this workdir (or flock is unavailable)
        for path in tmp.glob(f"{owner}*"):
            if path != lock:
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
                removed.append(path)
        lock.unlink(missing_ok=True)
        release(fd)
    for trash in tmp.glob("trash-*") if tmp.exists() else []:
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(trash)
    now = time.time()
    for kind in (p for p in root.iterdir() if p.is_dir() and p.name not in SERVICE_DIRS):
        for temp in kind.glob(".tmp-*"):
            try:
                if now - temp.stat().st_mtime > STALE_TEMP_S:
                    temp.unlink()
                    removed.append(temp)
            except OSError:
                pass
    return removed


def _touch(path: Path) -> None:
    """Record a use (the modification time is the entry's last use, for `cache gc`)."""
    try:
        os.utime(path)
    except OSError:
        pass


def _write_json_atomic(path: Path, value: Any) -> None:
    write_text_atomic(path, json.dumps(value, indent=2, sort_keys=True, default=str))


__all__ = ["StageCache", "LeaseSet", "default_cache_dir", "library_versions", "verify_entry", "write_manifest", "INFO_FILE"]
