"""The content-addressed stage cache.

A stage's output lives under `stages/<key>/`, where the key hashes everything the
output depends on (input model, pass name and version, params, data, library
versions). An entry is written in a private temp folder and published with one
rename, with a manifest of file hashes written last: a reader sees a whole entry
or none. A hit is re-hashed against its manifest; a corrupted entry is dropped
with a warning and recomputed. A per-key file lock keeps two processes from
computing the same entry at once.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

from filelock import FileLock

from optpipe.artifact import INFO_FILE, MANIFEST_FILE, ModelArtifact, content_hash, sha256_file, sha256_json

MANIFEST = MANIFEST_FILE
log = logging.getLogger("optpipe.cache")


def default_cache_dir() -> Path:
    return Path(os.environ.get("OPTPIPE_CACHE", Path.home() / ".cache" / "optpipe")).expanduser()


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
        for sub in ("stages", "tmp", "locks", "results"):
            (root / sub).mkdir(parents=True, exist_ok=True)

    @staticmethod
    def key(**parts: Any) -> str:
        return sha256_json(parts)

    def entry_dir(self, key: str) -> Path:
        return self.root / "stages" / key

    def lock(self, key: str) -> FileLock:
        return FileLock(str(self.root / "locks" / f"{key}.lock"))

    def new_workdir(self) -> Path:
        return Path(tempfile.mkdtemp(prefix="work-", dir=self.root / "tmp"))

    def lookup(self, key: str) -> ModelArtifact | None:
        """The verified entry for `key`, or None (a corrupted entry is removed)."""
        folder = self.entry_dir(key)
        if not folder.exists():
            return None
        problem = verify_entry(folder)
        if problem:
            log.warning("cache entry %s is corrupted (%s); recomputing it", key[:12], problem)
            self.discard(folder)
            return None
        return ModelArtifact.open(folder)

    def publish(self, key: str, workdir: Path) -> ModelArtifact:
        """Move a finished workdir into the cache under `key`, atomically."""
        files = {p.name: sha256_file(p) for p in sorted(workdir.iterdir()) if p.is_file() and p.name != MANIFEST}
        _write_json_atomic(workdir / MANIFEST, {"key": key, "files": files, "content": content_hash(files)})
        target = self.entry_dir(key)
        try:
            os.rename(workdir, target)
        except OSError:
            # Another process published the same key first: its entry is equivalent, keep it.
            shutil.rmtree(workdir, ignore_errors=True)
        return ModelArtifact.open(target)

    def discard(self, folder: Path) -> None:
        trash = self.root / "tmp" / f"trash-{uuid.uuid4().hex}"
        try:
            os.rename(folder, trash)
        except OSError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    # Small JSON results (evaluations), keyed the same way.
    def get_result(self, key: str) -> dict | None:
        path = self.root / "results" / f"{key}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def put_result(self, key: str, value: dict) -> None:
        _write_json_atomic(self.root / "results" / f"{key}.json", value)


def verify_entry(folder: Path) -> str | None:
    """None when every file matches the manifest; else what is wrong."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return "no readable manifest"
    present = {p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST}
    if present != set(manifest["files"]):
        return f"files differ from the manifest: {sorted(present ^ set(manifest['files']))}"
    for name, digest in manifest["files"].items():
        if sha256_file(folder / name) != digest:
            return f"{name} does not match its hash"
    if manifest.get("content") != content_hash(manifest["files"]):
        return "the manifest's content hash does not match its files"
    return None


def _write_json_atomic(path: Path, value: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as fh:
        json.dump(value, fh, indent=2, sort_keys=True, default=str)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


__all__ = ["StageCache", "default_cache_dir", "library_versions", "verify_entry", "INFO_FILE"]
