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

- A mounted folder (file://, a plain path) used as the remote: entries are built in its
  `tmp/` and renamed into place, as the local cache does (optpipe.cache.remote_io).

Whatever the remote holds is untrusted: a manifest's names and hashes are checked before any
file is written (optpipe.cache.manifest), every file is downloaded into a private workdir and
checked against its hash and declared size, and only then published locally with one rename.
A poisoned entry writes nothing outside the workdir and is recomputed with one warning line.

`TieredStageCache` puts both together: lookups fall through local -> object store (downloaded
into a workdir and published locally, verified); publishes go local, then up.
"""
from __future__ import annotations

import errno
import json
import logging
import shutil
from pathlib import Path
from typing import Any, Protocol

from optpipe.core.artifact import MANIFEST_FILE, content_hash, sha256_json
from optpipe.cache.manifest import UntrustedEntry, checked_files, checked_sizes
from optpipe.cache.remote_io import (check_remote, check_room, download_checked, dumps, is_local, publish_local_folder, read_capped,
                                     write_local_result)
from optpipe.cache.store import StageCache, read_result, verify_entry

log = logging.getLogger("optpipe.cache.backends")
# Manifest fields copied from a remote entry into the local one: labels for `cache ls`, nothing used as a path.
_LABELS = ("stage", "pass", "recipe", "source", "samples")


class EntryStore(Protocol):
    """A remote home for published cache entries (folders) and results (small JSON values)."""

    def fetch_folder(self, kind: str, key: str, dest: Path) -> dict | None:
        """Download the committed, verified entry into `dest` (an empty folder) and return its
        manifest; None when there is none or it is refused (then `dest` is left empty)."""

    def push_folder(self, kind: str, key: str, folder: Path) -> None:
        """Upload a published, verified entry: its files first, its manifest last."""

    def fetch_result(self, key: str) -> dict | None: ...

    def push_result(self, key: str, wrapped: dict) -> None: ...


class FsspecEntryStore:
    """Entries under `<url>/<kind>/<key>/`, results under `<url>/results/<key>.json`, through fsspec."""

    def __init__(self, url: str, **storage_options: Any):
        import fsspec

        self.url = url
        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/") or "/"
        self.local = is_local(self.fs)

    def check(self) -> str:
        """Usable before any work (else one line naming --remote-cache); the URL for other processes."""
        return check_remote(self.url, self.fs, self.root)

    def _entry(self, kind: str, key: str) -> str:
        return f"{self.root}/{kind}/{key}"

    def fetch_folder(self, kind: str, key: str, dest: Path) -> dict | None:
        base = self._entry(kind, key)
        try:
            raw = read_capped(self.fs, f"{base}/{MANIFEST_FILE}")
        except FileNotFoundError:
            return None  # no manifest: absent, or an upload that never committed
        except UntrustedEntry as exc:
            return self._refused(kind, key, str(exc), dest)
        try:
            manifest = _parse(raw)
            files = checked_files(manifest)
            sizes = checked_sizes(manifest, files)
            if manifest.get("content") != content_hash(files):
                raise UntrustedEntry("the manifest's content hash does not match its files")
            if "sizes" in manifest:  # an older manifest without sizes: each file is still stopped at MAX_FILE_BYTES
                check_room(dest, sizes)
            for name, digest in files.items():  # each name checked above: dest / name stays in dest
                download_checked(self.fs, f"{base}/{name}", dest / name, digest, sizes[name])
        except (UntrustedEntry, FileNotFoundError) as exc:
            reason = ("a listed file is missing (removed or changed during the download)" if isinstance(exc, FileNotFoundError)
                      else str(exc))
            return self._refused(kind, key, reason, dest)
        return manifest

    @staticmethod
    def _refused(kind: str, key: str, reason: str, dest: Path) -> None:
        log.warning("remote cache entry %s/%s is corrupted or untrusted (%s); recomputing it", kind, key[:12], reason)
        _empty(dest)

    def push_folder(self, kind: str, key: str, folder: Path) -> None:
        base = self._entry(kind, key)
        if self.local:
            publish_local_folder(self.root, folder, base, lambda target: verify_entry(target) is None)
            return
        files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST_FILE)
        for path in files:
            self.fs.put_file(str(path), f"{base}/{path.name}")
        self.fs.put_file(str(folder / MANIFEST_FILE), f"{base}/{MANIFEST_FILE}")  # the commit

    def fetch_result(self, key: str) -> dict | None:
        try:
            wrapped = _parse(read_capped(self.fs, f"{self.root}/results/{key}.json"))
        except FileNotFoundError:
            return None
        except UntrustedEntry as exc:
            log.warning("remote cache result %s is corrupted or untrusted (%s); recomputing it", key[:12], exc)
            return None
        value = wrapped.get("value")
        if not isinstance(value, dict) or sha256_json(value) != wrapped.get("sha256"):
            log.warning("remote cache result %s is corrupted; recomputing it", key[:12])
            return None
        return wrapped

    def push_result(self, key: str, wrapped: dict) -> None:
        path = f"{self.root}/results/{key}.json"
        if self.local:
            write_local_result(path, dumps(wrapped))
        else:
            self.fs.pipe_file(path, json.dumps(wrapped, sort_keys=True).encode())


class TieredStageCache(StageCache):
    """A local StageCache backed by a remote store: misses fall through to it, publishes go up.

    The remote is a speed-up, never a dependency: one that fails (unreachable, credentials
    refused, read-only) gives one warning line, and this process goes on with the local cache
    alone. A full local disk is not the remote's failure: it propagates (the run stops)."""

    def __init__(self, root: Path, remote: EntryStore):
        super().__init__(root)
        self.remote = remote

    def _remote(self, what: str, call, *args):
        """`call(*args)`, or None when the remote is off or fails (then it is off in this process)."""
        name = str(getattr(self.remote, "url", id(self.remote)))
        if name in _REMOTES_OFF:
            return None
        try:
            return call(*args)
        except UntrustedEntry as exc:  # the local entry stands; only this upload is refused
            log.warning("remote cache: not uploading %s (%s)", what, exc)
        except OSError as exc:
            if exc.errno in LOCAL_DISK_ERRNOS:
                raise
            _remote_off(name, what, exc)
        except Exception as exc:  # noqa: BLE001 (fsspec backends raise their own types: botocore, aiohttp, ...)
            _remote_off(name, what, exc)
        return None

    def lookup_folder(self, key: str, kind: str) -> Path | None:
        folder = super().lookup_folder(key, kind)
        if folder is not None:
            return folder
        workdir = self.new_workdir()
        try:
            manifest = self._remote(f"{kind}/{key[:12]}", self.remote.fetch_folder, kind, key, workdir)
            if manifest is None:
                return None
            (workdir / MANIFEST_FILE).unlink(missing_ok=True)  # publish writes its own manifest over the same files
            return self.publish_folder(key, workdir, kind, _manifest_meta(manifest))
        finally:
            self.release_workdir(workdir)

    def publish_folder(self, key: str, workdir: Path, kind: str, meta: dict[str, Any] | None = None) -> Path:
        target = super().publish_folder(key, workdir, kind, meta)
        if meta is None or not meta.get("from_remote"):
            self._remote(f"{kind}/{key[:12]}", self.remote.push_folder, kind, key, target)
        return target

    def get_result(self, key: str) -> dict | None:
        value = super().get_result(key)
        if value is not None:
            return value
        wrapped = self._remote(f"result {key[:12]}", self.remote.fetch_result, key)
        if wrapped is None:
            return None
        super().put_result(key, wrapped["value"])
        return wrapped["value"]

    def put_result(self, key: str, value: dict) -> None:
        super().put_result(key, value)
        path = self.result_path(key)
        wrapped, problem = read_result(path)
        if problem is None:
            self._remote(f"result {key[:12]}", self.remote.push_result, key, {"sha256": sha256_json(wrapped), "value": wrapped})


# Remote caches that failed in this process (by URL): each is warned about once, then left alone.
_REMOTES_OFF: set[str] = set()
# A full or read-only local disk: the run's own problem (one line naming the folder), not the remote's.
LOCAL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def _remote_off(name: str, what: str, exc: BaseException) -> None:
    _REMOTES_OFF.add(name)
    text = str(exc).splitlines()[0] if str(exc) else ""
    log.warning("remote cache %s failed on %s (%s%s); this process goes on with the local cache only", name, what,
                type(exc).__name__, f": {text[:200]}" if text else "")


def _parse(raw: bytes) -> dict:
    try:
        value = json.loads(raw)
    except ValueError:
        raise UntrustedEntry("not valid JSON") from None
    if not isinstance(value, dict):
        raise UntrustedEntry("not a JSON object")
    return value


def _empty(folder: Path) -> None:
    for path in folder.iterdir():
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)


def _manifest_meta(manifest: dict) -> dict[str, Any]:
    labels = {k: v for k in _LABELS if isinstance(v := manifest.get(k), (str, int)) and len(str(v)) <= 200}
    return {**labels, "from_remote": True}


def open_remote(url: str, **storage_options: Any) -> FsspecEntryStore:
    """The remote store behind --remote-cache; a missing fsspec backend is one line naming the package."""
    from optpipe.core.errors import OptpipeError

    try:
        return FsspecEntryStore(url, **storage_options)
    except ImportError as exc:
        raise OptpipeError(f"--remote-cache {url}: its filesystem is not installed ({exc}); pip install 'optpipe[s3]' "
                           "for s3://, gcsfs for gs://") from None
    except ValueError as exc:  # an unknown protocol
        raise OptpipeError(f"--remote-cache {url}: {exc}; use s3://, gs://, file:// or a folder path") from None


def open_cache(root: Path, remote_url: str | None = None, **storage_options: Any) -> StageCache:
    """The cache a run uses: the local folder, backed by a remote store when a URL is given."""
    if not remote_url:
        return StageCache(root)
    return TieredStageCache(root, FsspecEntryStore(remote_url, **storage_options))
