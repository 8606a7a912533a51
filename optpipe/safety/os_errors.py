"""File-system failures that are the environment's fault, as one line naming the folder and the fix.

An output or cache folder that is a file, read-only, on a full disk or with a name too
long used to end in a traceback or "internal error". These are the user's to fix
(exit code 2). A full or read-only disk met while a stage runs stops the whole run:
every later stage would fail the same way, and the cache stays consistent because
entries are published atomically (optpipe.cache.store).
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Iterator

from optpipe.core.errors import OptpipeError

# Errors no stage can work around: the run stops with exit 2.
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}
# errno -> (what is wrong, what to do)
_PROBLEMS = {
    errno.ENOSPC: ("the disk is full", "free space there"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space there"),
    errno.EROFS: ("it is on a read-only file system", "make it writable"),
    errno.EACCES: ("permission is denied", "grant access"),
    errno.EPERM: ("permission is denied", "grant access"),
    errno.ENAMETOOLONG: ("a name in its path is too long for the file system", "use a shorter name"),
    errno.ENOTDIR: ("a file stands where a folder is needed", "remove that file"),
    errno.EEXIST: ("a file stands where a folder is needed", "remove that file"),
    errno.EISDIR: ("a folder stands where a file is needed", "remove that folder"),
    errno.ELOOP: ("its path has a symlink loop", "fix the link"),
}


class FolderError(OptpipeError):
    """An output or cache folder cannot be written (exit code 2)."""


#: The flag that moves each folder a run writes.
_FLAGS = {"output folder": "--output", "cache folder": "--cache-dir"}


def describe(exc: OSError, role: str = "", folder: Path | None = None) -> str | None:
    """One line for an environment OSError, or None when it is not one of those. It names `role`
    ('output folder') and `folder` only when the failed file is inside it: a copy from the cache into
    a full output folder is the output folder's disk, not the cache's."""
    if (exc.errno or 0) not in _PROBLEMS:
        return None
    problem, fix = _PROBLEMS[exc.errno]
    failed = failed_file(exc)
    if role and folder is not None and (failed is None or _inside(failed, folder)):
        where = f"{role} '{folder}'" + (f" ({failed})" if failed and str(failed) != str(folder) else "")
        flags = _FLAGS.get(role, "--output, --cache-dir")
    else:
        where = f"'{failed}'" if failed else "the disk"  # a flush on close carries no file name
        flags = "--output, --cache-dir"
    return f"cannot use {where}: {problem}; {fix} or choose another folder ({flags})"


def failed_file(exc: OSError) -> str | None:
    """The file an OSError is about. A copy or rename that fails for its disk (full, read-only) fails on
    its destination, which shutil and os.replace give as filename2; filename is the source."""
    if exc.errno in DISK_ERRNOS and exc.filename2:
        return str(exc.filename2)
    return str(exc.filename) if exc.filename else None


def _inside(path: str, folder: Path) -> bool:
    try:
        return Path(os.path.abspath(path)).is_relative_to(os.path.abspath(folder))
    except (TypeError, ValueError):
        return False


def disk_error_in(exc: BaseException) -> OSError | None:
    """A full or read-only disk anywhere in an exception's cause/context chain."""
    for link in chain(exc):
        if isinstance(link, OSError) and link.errno in DISK_ERRNOS:
            return link
    return None


#: Below this much free space, a failure is taken for the full disk it most likely is.
NEARLY_FULL_BYTES = 64 << 20


def full_disk_at(folder: Path | None) -> OSError | None:
    """An ENOSPC for `folder` when its disk is (nearly) full now. Libraries that write in C++ say a full disk in
    words of their own, with no errno: ONNX Runtime "Failed to write external initializers to file", torch's
    writer "36864 requested and 1344 written"; the stage then failed with advice that could not help."""
    if folder is None:
        return None
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    if free >= NEARLY_FULL_BYTES:
        return None
    return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({free >> 20} MB free)", str(folder))


def chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception, then its causes and contexts (each once; chains can loop)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        link = todo.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        yield link
        todo.extend((link.__context__, link.__cause__))


@contextlib.contextmanager
def folder_errors(role: str, folder: Path) -> Iterator[None]:
    """OSErrors while preparing `folder` (the run folder, the cache) become one FolderError line."""
    try:
        yield
    except OSError as exc:
        message = describe(exc, role, folder) or _not_creatable(exc, role, folder)
        if message is None:
            raise
        raise FolderError(message) from None


def _not_creatable(exc: OSError, role: str, folder: Path) -> str | None:
    """A folder the file system will not create, or a file it will not create in it, although the parent exists
    (mkdir or a new file under /proc says ENOENT): only for the folder itself or a path inside it, since ENOENT
    elsewhere may be a bug of ours."""
    failed = failed_file(exc)
    if exc.errno != errno.ENOENT or failed is None or not _inside(failed, folder):
        return None
    return (f"cannot use {role} '{folder}': the file system there creates nothing (a virtual one such as /proc or "
            f"/sys?); choose a folder on a disk ({_FLAGS.get(role, '--output, --cache-dir')})")
