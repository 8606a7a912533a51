"""What a cache entry's manifest may say: it is untrusted data, checked before any file is written.

A manifest (`entry.json`) names an entry's files and their sha256. Whoever can write to a
shared cache (a bucket, a shared folder, a local cache another user can write) can write any
manifest, so nothing in it is used as a path until it passes these rules:
- every name is a plain file name: letters, digits, `.`, `_`, `-`, at most NAME_MAX
  characters, not `.` and without `..`: no folder separator of any system (`/`, `\\`), no
  drive letter (`:`), no NUL, so `folder / name` stays inside the entry's own folder;
- names differ when case is ignored (on a case-insensitive filesystem two would be one file);
- at most MAX_FILES names, each hash 64 lowercase hex digits, each declared size (when the
  manifest has sizes: optpipe writes them) a whole number of bytes under MAX_FILE_BYTES;
- the manifest itself is under MAX_MANIFEST_BYTES (read that far, no further).
An entry's files are flat (a model, its external data, info.json): no subfolders exist to allow.
"""
from __future__ import annotations

import re
from typing import Any

from optpipe.core.artifact import MANIFEST_FILE

MAX_FILES = 64
NAME_MAX = 128
MAX_MANIFEST_BYTES = 1 << 20
MAX_FILE_BYTES = 1 << 40  # 1 TiB: far above any model, far below what a forged size could claim
_NAME = re.compile(rf"[A-Za-z0-9._-]{{1,{NAME_MAX}}}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class UntrustedEntry(ValueError):
    """A manifest that breaks the rules above; the message says which rule."""


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name or name == ".":
        raise UntrustedEntry(f"the manifest names {str(name)[:80]!r}, not a plain file name inside the entry")
    if name == MANIFEST_FILE:
        raise UntrustedEntry(f"the manifest lists itself ({MANIFEST_FILE})")
    return name


def checked_files(manifest: Any) -> dict[str, str]:
    """The manifest's {file name: sha256}, every name and hash checked; raises UntrustedEntry."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise UntrustedEntry("no file list in the manifest")
    files = manifest["files"]
    if not files or len(files) > MAX_FILES:
        raise UntrustedEntry(f"the manifest lists {len(files)} files (1 to {MAX_FILES} expected)")
    folded: set[str] = set()
    for name, digest in files.items():
        check_name(name)
        if name.casefold() in folded:
            raise UntrustedEntry(f"the manifest lists {name!r} twice when case is ignored")
        folded.add(name.casefold())
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise UntrustedEntry(f"the hash of {name!r} is not a sha256 (64 hex digits)")
    return dict(files)


def checked_sizes(manifest: dict, files: dict[str, str]) -> dict[str, int]:
    """Each file's declared size (MAX_FILE_BYTES where an older manifest declares none)."""
    sizes = manifest.get("sizes")
    if sizes is None:
        return {name: MAX_FILE_BYTES for name in files}
    if not isinstance(sizes, dict) or set(sizes) != set(files):
        raise UntrustedEntry("the manifest's sizes do not name its files")
    for name, size in sizes.items():
        if type(size) is not int or not 0 <= size <= MAX_FILE_BYTES:
            raise UntrustedEntry(f"the size of {name!r} ({str(size)[:40]}) is not a byte count under {MAX_FILE_BYTES}")
    return dict(sizes)


__all__ = ["UntrustedEntry", "check_name", "checked_files", "checked_sizes", "MAX_FILES", "MAX_MANIFEST_BYTES"]
