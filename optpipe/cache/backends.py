"""Cache backends: where published entries live, with the same content addressing everywhere.

- The local folder (optpipe.cache.store.StageCache) is the working tier: entries are built in
  a workdir and published with one rename, under a per-key lock. A shared filesystem path
  (NFS, CephFS, Lustre, EFS) seen by every node keeps those guarantees when it offers atomic
  rename within a folder and working `flock` (see docs/scale-out.md).
- An object store (s3://, gs://, through fsspec) has neither rename nor locks, but a single
  object PUT is atomic. So an entry is uploaded file by file and its manifest (`entry.json`:
  every file's sha256 and the content hash) last: the manifest is the commit. A reader sees
  an entry only when its manifest exists, and checks every file it downloads against it, so a
  writer killed mid-upload leaves an invisible partial entry, never a wrong one. Two writers
  of one key upload the same content (the key hashes everything the content depends on): the
  last manifest wins and is as good as the first; work may be duplicated, results are not
  corrupted.

`TieredStageCache` puts both together: lookups fall through local -> object store (downloaded
into a workdir and published locally, verified); publishes go local, then up.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Protocol

from optpipe.core.artifact import MANIFEST_FILE, sha256_json
from optpipe.cache.store import StageCache, read_result, verify_entry

log = logging.getLogger("optpipe.cache.backends")


class EntryStore(Protocol):
    """A remote home for published cache entries (folders) and results (small JSON values)."""

    def fetch_folder(self, kind: str, key: str, dest: Path) -> bool:
        """Download the committed entry into `dest` (an empty folder); False when there is none."""

    def push_folder(self, kind: str, key: str, folder: Path) -> None:
        """Upload a published, verified entry: its files first, its manifest last."""

    def fetch_result(self, key: str) -> dict | None: ...

    def push_result(self, key: str, wrapped: dict) -> None: ...


class FsspecEntryStore:
    """Entries under `<url>/<kind>/<key>/`, results under `<url>/results/<key>.json`, through fsspec."""

    def __init__(self, url: str, **storage_options: Any):
        import fsspec

        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/")

    def _entry(self, kind: str, key: str) -> str:
        return f"{self.root}/{kind}/{key}"

    def fetch_folder(self, kind: str, key: str, dest: Path) -> bool:
        base = self._entry(kind, key)
        try:
            manifest = json.loads(self.fs.cat_file(f"{base}/{MANIFEST_FILE}"))
        except FileNotFoundError:
            return False  # no manifest: absent, or an upload that never committed
        for name in manifest.get("files", {}):
            self.fs.get_file(f"{base}/{name}", str(dest / name))
        (dest / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        problem = verify_entry(dest)
        if problem:
            log.warning("remote cache entry %s/%s is corrupted (%s); recomputing it", kind, key[:12], problem)
            return False
        return True

    def push_folder(self, kind: str, key: str, folder: Path) -> None:
        base = self._entry(kind, key)
        files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST_FILE)
        for path in files:
            self.fs.put_file(str(path), f"{base}/{path.name}")
        self.fs.put_file(str(folder / MANIFEST_FILE), f"{base}/{MANIFEST_FILE}")  # the commit

    def fetch_result(self, key: str) -> dict | None:
        try:
            wrapped = json.loads(self.fs.cat_file(f"{self.root}/results/{key}.json"))
        except (FileNotFoundError, ValueError):
            return None
        if not isinstance(wrapped, dict) or sha256_json(wrapped.get("value")) != wrapped.get("sha256"):
            log.warning("remote cache result %s is corrupted; recomputing it", key[:12])
            return None
        return wrapped

    def push_result(self, key: str, wrapped: dict) -> None:
        self.fs.pipe_file(f"{self.root}/results/{key}.json", json.dumps(wrapped, sort_keys=True).encode())


class TieredStageCache(StageCache):
    """A local StageCache backed by an object store: misses fall through to it, publishes go up."""

    def __init__(self, root: Path, remote: EntryStore):
        super().__init__(root)
        self.remote = remote

    def lookup_folder(self, key: str, kind: str) -> Path | None:
        folder = super().lookup_folder(key, kind)
        if folder is not None:
            return folder
        workdir = self.new_workdir()
        try:
            if not self.remote.fetch_folder(kind, key, workdir):
                return None
            (workdir / MANIFEST_FILE).unlink()  # publish writes its own manifest over the same files
            return self.publish_folder(key, workdir, kind, _manifest_meta(workdir, key))
        finally:
            self.release_workdir(workdir)

    def publish_folder(self, key: str, workdir: Path, kind: str, meta: dict[str, Any] | None = None) -> Path:
        target = super().publish_folder(key, workdir, kind, meta)
        if meta is None or not meta.get("from_remote"):
            self.remote.push_folder(kind, key, target)
        return target

    def get_result(self, key: str) -> dict | None:
        value = super().get_result(key)
        if value is not None:
            return value
        wrapped = self.remote.fetch_result(key)
        if wrapped is None:
            return None
        super().put_result(key, wrapped["value"])
        return wrapped["value"]

    def put_result(self, key: str, value: dict) -> None:
        super().put_result(key, value)
        path = self.result_path(key)
        wrapped, problem = read_result(path)
        if problem is None:
            self.remote.push_result(key, {"sha256": sha256_json(wrapped), "value": wrapped})


def _manifest_meta(workdir: Path, key: str) -> dict[str, Any]:
    return {"from_remote": True}


def open_cache(root: Path, remote_url: str | None = None, **storage_options: Any) -> StageCache:
    """The cache a run uses: the local folder, backed by an object store when a URL is given."""
    if not remote_url:
        return StageCache(root)
    return TieredStageCache(root, FsspecEntryStore(remote_url, **storage_options))
