"""Reading and writing a remote cache's files through fsspec, trusting nothing they say.

A remote entry is downloaded into a private workdir, file by file, each file streamed
through its hash and stopped at its declared size: nothing is written under a name the
manifest rules (optpipe.cache.manifest) refuse, no download grows past what the manifest
declares, and nothing reaches the local cache until every hash matched (the caller then
publishes the workdir with one rename).

A remote folder on a mounted filesystem (file://, a plain path: NFS, Lustre, CephFS, EFS)
is written the way the local cache is: an entry is built in `<root>/tmp/` and moved into
place with one rename, a result replaced atomically; anything there that is a symlink or
not a plain file is refused.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import time
import uuid
from pathlib import Path
from typing import Any

from optpipe.cache.manifest import MAX_MANIFEST_BYTES, UntrustedEntry
from optpipe.core.errors import OptpipeError

CHUNK = 1 << 20
# A publisher's staging folder older than this was left by a killed process (a publish takes seconds).
STALE_S = 86400.0


def is_local(fs: Any) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "file" in protocol or "local" in protocol


def check_plain(fs: Any, path: str) -> None:
    """On a mounted folder, a symlink (or a fifo, a device) in an entry is refused: the entry
    would make optpipe read a file outside the remote cache into its own."""
    if is_local(fs):
        mode = os.lstat(path).st_mode  # FileNotFoundError: absent, as on an object store
        if not stat.S_ISREG(mode):
            raise UntrustedEntry(f"{Path(path).name} is a link or a special file, not a plain file")


def read_capped(fs: Any, path: str, limit: int = MAX_MANIFEST_BYTES) -> bytes:
    """A small file's bytes (a manifest, a result), refused past `limit` without reading further."""
    check_plain(fs, path)
    with fs.open(path, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise UntrustedEntry(f"{Path(path).name} is over {limit} bytes")
    return data


def download_checked(fs: Any, src: str, dst: Path, digest: str, size: int) -> None:
    """Stream `src` into the new file `dst`, hashing it; refused (and `dst` removed) when it
    grows past `size` or its sha256 is not `digest` (a truncated, changed or forged file)."""
    check_plain(fs, src)
    sha = hashlib.sha256()
    written = 0
    # O_EXCL: dst is a fresh name in a fresh workdir; never follow or reuse anything there.
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as out, fs.open(src, "rb") as fh:
            while block := fh.read(min(CHUNK, size - written + 1)):
                written += len(block)
                if written > size:
                    raise UntrustedEntry(f"{dst.name} is larger than its declared {size} bytes")
                sha.update(block)
                out.write(block)
        if sha.hexdigest() != digest:
            raise UntrustedEntry(f"{dst.name} does not match its hash (a truncated or changed download)")
    except BaseException:
        dst.unlink(missing_ok=True)
        raise


def check_room(dest: Path, sizes: dict[str, int]) -> None:
    """A manifest declaring more bytes than the disk has free is refused before any download:
    forged sizes (64 files of a terabyte) would otherwise fill the disk and stop the run."""
    total, free = sum(sizes.values()), shutil.disk_usage(dest).free
    if total > free:
        raise UntrustedEntry(f"it declares {total} bytes, more than the {free} free where it would be downloaded")


def sweep_stale(root: str, now: float | None = None) -> None:
    """Staging and trash folders a killed publisher left in `<root>/tmp` (older than STALE_S)."""
    tmp = Path(root) / "tmp"
    now = time.time() if now is None else now
    for path in tmp.glob("*-*") if tmp.is_dir() and not tmp.is_symlink() else []:
        try:
            stale = path.name.startswith(("push-", "trash-")) and now - path.lstat().st_mtime > STALE_S
        except OSError:
            continue
        if stale and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)


def publish_local_folder(root: str, folder: Path, target: str, still_valid) -> None:
    """Copy a verified entry to a mounted remote folder: into `<root>/tmp/`, then one rename.

    When `target` exists, another writer published first: its entry is kept when
    `still_valid(target)` (same key, same content), else (a tampered entry) it is replaced."""
    _no_links(root, Path(target).parent, Path(root) / "tmp")
    sweep_stale(root)
    staging = Path(root) / "tmp" / f"push-{uuid.uuid4().hex}"
    staging.mkdir(parents=True)
    try:
        for path in sorted(folder.iterdir()):
            if path.is_file():
                shutil.copyfile(path, staging / path.name)
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        if not _rename_into(staging, Path(target)):
            if still_valid(Path(target)):
                return
            trash = Path(root) / "tmp" / f"trash-{uuid.uuid4().hex}"
            try:
                os.rename(target, trash)  # out of sight first, so no reader sees half of it
            except FileNotFoundError:
                pass
            _rename_into(staging, Path(target))
            shutil.rmtree(trash, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _no_links(root: str, *folders: Path) -> None:
    """The remote's own folders (tmp/, stages/, results/) may not be symlinks: one planted there
    by whoever can write the shared folder would make a publish write wherever it points."""
    for folder in folders:
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            raise UntrustedEntry(f"'{folder}' in the remote cache '{root}' is a link or a file, not a folder")


def _rename_into(src: Path, dst: Path) -> bool:
    try:
        os.rename(src, dst)
        return True
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
            return False
        raise


def write_local_result(path: str, data: bytes) -> None:
    """A result on a mounted folder: temp file beside it, then one atomic replace."""
    target = Path(path)
    _no_links(str(target.parent.parent), target.parent)
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_name(f".tmp-{uuid.uuid4().hex}.json")
    try:
        temp.write_bytes(data)
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def check_remote(url: str, fs: Any, root: str) -> str:
    """The remote cache usable before any work, else one line naming --remote-cache; returns the URL
    every process can open (a relative path made absolute: a Ray worker's working folder differs)."""
    if is_local(fs):
        return _check_local(url, Path(root))
    try:
        fs.ls(root)
    except FileNotFoundError:
        _check_bucket(url, fs, root)  # a new prefix with nothing under it yet is fine; a missing bucket is not
    except Exception as exc:  # noqa: BLE001 (fsspec backends raise their own types: say which and why)
        raise OptpipeError(f"--remote-cache {url}: cannot list it ({_why(exc)})") from None
    return url


def check_apart(url: str, cache_root: Path) -> None:
    """A remote folder that is the local cache, or nests with it, would be pruned by `cache gc`
    (or publish into itself): refused, naming --remote-cache."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    if not is_local(fs):
        return
    remote, cache = (Path(os.path.realpath(p)) for p in (root, cache_root.expanduser()))
    if remote == cache or remote.is_relative_to(cache) or cache.is_relative_to(remote):
        raise OptpipeError(f"--remote-cache {url}: the remote folder and the local cache '{cache_root}' are the same or "
                           "nest; point --remote-cache at a folder apart from --cache-dir")


def _check_local(url: str, root: Path) -> str:
    """Nothing is created here (the first publish creates the folders): a check has no side effects."""
    if root.exists() and not root.is_dir():
        raise OptpipeError(f"--remote-cache {url}: '{root}' is a file, not a folder; point --remote-cache at a folder "
                           "(a missing one is created)")
    existing = next(p for p in (root, *root.parents) if p.exists())
    if not existing.is_dir():
        raise OptpipeError(f"--remote-cache {url}: cannot create the folder '{root}' ('{existing}' is a file); point "
                           "--remote-cache at a folder you can write")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OptpipeError(f"--remote-cache {url}: the folder '{existing}' is not writable; point --remote-cache at a "
                           "folder you can write")
    return str(root)


def _check_bucket(url: str, fs: Any, root: str) -> None:
    bucket = root.split("/", 1)[0]
    try:
        exists = fs.exists(bucket)
    except Exception as exc:  # noqa: BLE001
        raise OptpipeError(f"--remote-cache {url}: cannot list it ({_why(exc)})") from None
    if not exists:
        raise OptpipeError(f"--remote-cache {url}: the bucket '{bucket}' does not exist; create it or point "
                           "--remote-cache at another")


def _why(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def dumps(value: Any) -> bytes:
    return json.dumps(value, indent=2, sort_keys=True).encode()
